"""Meta-tests of ``tqbatch.testing.oracles.rounding``: the choices rounding leaves a quantizer.

The admissible set must contain what mlx-vlm's codec writes, admit another
code only at a coordinate within the rounding band of a midpoint (and a
float16 norm only next to a rounding boundary), and reject everything a
bug produces. In the harness, a cache that rounds otherwise than the
reference (inputs nudged far below any bug, as another summation order on a
GPU would) must pass, where it failed before the harness admitted rounding;
nudged past the band, it must fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.turboquant import _TurboQuantMSECodec, _unpack_lowbit

import tqbatch
from tqbatch.testing.oracles import reference as reference_module
from tqbatch.testing.oracles.rounding import AdmissibleCodes, rotation_error
from tqbatch.testing.oracles.tolerances import content_tolerance
from tqbatch.testing.selfcheck.doubles import RoundsFarOtherwise, RoundsOtherwise
from tqbatch.testing.world import World

# Powers of two use the Hadamard rotation, the others a dense one.
CODECS = [(64, 4), (80, 2), (128, 8), (96, 3), (32, 1)]

# What these tests quantify is float32's band (1.1e-5 at D=128): at TF32 it is
# 3.9e-3, a third of an 8-bit interval and past a float16 norm's quarter ulp,
# and the content bound itself covers a 1e-5 nudge.
_FLOAT32_BAND = pytest.mark.float32_only(reason="quantifies the float32 rounding band")


def _round_trip(codec, x: np.ndarray) -> np.ndarray:
    return np.array(codec.dequantize(codec.quantize(mx.array(x))), np.float64)


@pytest.mark.parametrize(("dim", "bits"), CODECS)
def test_the_codecs_own_output_is_admitted_and_its_codes_predicted(dim, bits):
    codec = _TurboQuantMSECodec(dim, bits, seed=3)
    model = AdmissibleCodes(codec)
    x = np.random.default_rng(dim + bits).standard_normal((2, 50, dim)).astype(np.float32)
    got = _round_trip(codec, x)
    assert model.admits(got, x, content_tolerance(got)).all()
    norms, codes, alternatives = model.choices(x)
    packed = codec.quantize(mx.array(x))
    written = np.array(_unpack_lowbit(packed.indices, bits, dim))
    # Only coordinates inside the band may be written otherwise than predicted.
    assert ((written == codes) | (written == alternatives)).all()


@_FLOAT32_BAND
@pytest.mark.parametrize(("dim", "bits"), CODECS)
def test_the_band_leaves_few_coordinates_a_choice(dim, bits):
    # Twice the float32 band over the narrowest interval: ~2 % of coordinates
    # at 8 bits (intervals ~1e-3 wide), far fewer below.
    model = AdmissibleCodes(_TurboQuantMSECodec(dim, bits, seed=3))
    x = np.random.default_rng(dim + bits).standard_normal((2, 50, dim)).astype(np.float32)
    _, codes, alternatives = model.choices(x)
    assert (alternatives != codes).mean() < 0.05


def _nudged_to_a_midpoint(codec, model, x: np.ndarray, coord: int, offset: float) -> np.ndarray:
    """``x`` moved so that rotated coordinate ``coord`` sits ``offset`` above a midpoint."""
    norm = np.linalg.norm(x)
    rotated = (x / norm) @ model.forward
    m = model.midpoints[np.argmin(np.abs(model.midpoints - rotated[coord]))]
    rotated[coord] = m + offset
    return (norm * rotated @ model.forward.T).astype(np.float32)


def _flipped(codec, model, x: np.ndarray, coord: int) -> np.ndarray:
    """The dequantization of ``x`` with coordinate ``coord`` in the other cell of its midpoint."""
    norms, codes, _ = model.choices(x)
    rotated = (x / np.linalg.norm(x)) @ model.forward
    m = np.argmin(np.abs(model.midpoints - rotated[coord]))
    codes = codes.copy()
    codes[coord] = m if codes[coord] == m + 1 else m + 1
    return (norms[0] * model.codebook[codes]) @ model.forward.T


@_FLOAT32_BAND
@pytest.mark.parametrize(("dim", "bits"), CODECS[:3])
def test_another_code_is_admitted_only_within_the_band(dim, bits):
    codec = _TurboQuantMSECodec(dim, bits, seed=1)
    model = AdmissibleCodes(codec)
    base = np.random.default_rng(7).standard_normal(dim)
    band = rotation_error(dim)
    for offset, admitted in ((0.5 * band, True), (-0.5 * band, True), (3 * band, False)):
        x = _nudged_to_a_midpoint(codec, model, base, coord=5, offset=offset)
        got = _flipped(codec, model, x, coord=5)
        ok = model.admits(got[None], x[None], content_tolerance(got[None]))[0]
        assert ok == admitted, (offset, band)


def test_bugs_are_not_admitted():
    codec = _TurboQuantMSECodec(64, 4, seed=0)
    model = AdmissibleCodes(codec)
    x = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    good = _round_trip(codec, x)
    tol = content_tolerance(good)
    wrong = {
        "another token": np.roll(good, 1, axis=0),
        "shifted coordinates": np.roll(good, 1, axis=1),
        "poison scale": 16.0 * good,
        "zeros": np.zeros_like(good),
        "full precision": x.astype(np.float64),
        "another seed's codec": _round_trip(_TurboQuantMSECodec(64, 4, seed=1), x),
        "two bits": _round_trip(_TurboQuantMSECodec(64, 2, seed=0), x),
    }
    for name, got in wrong.items():
        assert not model.admits(got, x, tol).any(), name


@pytest.mark.parametrize("dim", [64, 128])
def test_at_tf32_a_4_bit_bug_is_still_not_admitted(dim):
    """TF32's band and content bound, computed here whatever the backend: at 4 bits
    the codec's output is admitted and no bug is. Each rotated coordinate is held
    to the content bound; the worst case, sqrt(D) times it, admitted 50-78 % of
    full-precision tokens here (an H200's TF32 suite found it). At 8 bits TF32's
    band spans most intervals: such fine claims are float32's."""
    codec = _TurboQuantMSECodec(dim, 4, seed=0)
    model = AdmissibleCodes(codec, precision="tf32")
    x = np.random.default_rng(0).standard_normal((40, dim)).astype(np.float32)
    good = _round_trip(codec, x)
    tol = content_tolerance(good, precision="tf32")
    assert model.admits(good, x, tol).all()
    wrong = {
        "full precision": x.astype(np.float64),
        "another seed's codec": _round_trip(_TurboQuantMSECodec(dim, 4, seed=1), x),
        "another token": np.roll(good, 1, axis=0),
        "two bits": _round_trip(_TurboQuantMSECodec(dim, 2, seed=0), x),
    }
    for name, got in wrong.items():
        assert not model.admits(got, x, tol).any(), name


@_FLOAT32_BAND
def test_a_norm_rounds_either_way_only_next_to_a_float16_boundary():
    codec = _TurboQuantMSECodec(64, 4, seed=0)
    model = AdmissibleCodes(codec)
    x = np.random.default_rng(1).standard_normal(64)
    norm = np.linalg.norm(x)
    ulp = float(np.spacing(np.float16(norm)))
    at_boundary = x * (float(np.float16(norm)) + ulp / 2) / norm  # exact norm on a tie
    inside = x * (float(np.float16(norm)) + ulp / 4) / norm
    below, above = float(np.float16(norm)), float(np.float16(norm)) + ulp
    for y, both in ((at_boundary, True), (inside, False)):
        norms, codes, _ = model.choices(y[None])
        assert (norms[0, 0] != norms[0, 1]) == both
        # The float16 neighbour above the exact norm: a rounding choice only at the tie.
        got = (above * model.codebook[codes[0]]) @ model.forward.T
        assert model.admits(got[None], y[None], content_tolerance(got[None]))[0] == both
        got = (below * model.codebook[codes[0]]) @ model.forward.T
        assert model.admits(got[None], y[None], content_tolerance(got[None]))[0]


OPS = [
    {"op": "merge", "lengths": [40, 25, 33], "kv_seed": 1},
    {"op": "update", "tokens": 30, "kv_seed": 2},
    {"op": "attend", "queries": 4, "q_heads": 4, "q_seed": 3},
    {"op": "attend", "queries": 1, "q_heads": 4, "q_seed": 4},
    {"op": "extract", "index": 1},
]


def _run(impl, bits):
    world = World(impl, bits=bits, seed=0, kv_heads=2, head_dim=64)
    for op in OPS:
        world.apply(op)
        world.check()
    return world


@_FLOAT32_BAND
@pytest.mark.parametrize("bits", [4.0, 8.0])
def test_a_cache_that_rounds_otherwise_passes_where_it_failed_before(bits, monkeypatch):
    world = _run(RoundsOtherwise, bits)
    assert world.refs.admitted > 0  # the nudge did move codes or norms
    monkeypatch.setattr(reference_module.TurboReferences, "admit_rounding", lambda *a: None)
    with pytest.raises(AssertionError, match="differ"):
        _run(RoundsOtherwise, bits)


@_FLOAT32_BAND
@pytest.mark.parametrize("bits", [4.0, 8.0])
def test_a_cache_past_the_band_still_fails(bits):
    with pytest.raises(AssertionError, match="dequantized (keys|values) differ"):
        _run(RoundsFarOtherwise, bits)


def test_a_campaign_counts_the_rounding_choices_it_admitted():
    from tqbatch.testing.search.campaign import run_campaign

    result = run_campaign(RoundsOtherwise, examples=8, profile="ci", seed=0)
    assert result.failures == []
    assert result.rounding_admitted > 0
    assert (
        run_campaign(tqbatch.BatchTurboQuantKVCache, examples=8, profile="ci").rounding_admitted
        == 0
    )
