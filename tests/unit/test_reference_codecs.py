"""The references' codecs: one pair per integer-width configuration, read-only, never the
target's, and deaf to writes into mlx-vlm's shared tables."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_vlm.turboquant import _codebook, _SplitCodec

import tqbatch
from tqbatch.testing.oracles.reference import TurboReferences
from tqbatch.testing.oracles.reference_codecs import reference_codecs
from tqbatch.testing.oracles.tolerances import content_tolerance
from tqbatch.testing.world import World

CONFIG = dict(bits=3.0, seed=2, key_bits=None, value_bits=4.0)


def _tokens(dim=96, positions=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, positions, dim)).astype(np.float32)


def _arrays(codec) -> dict:
    return {k: np.array(v) for k, v in vars(codec).items() if isinstance(v, mx.array)}


def test_one_pair_per_configuration_and_head_dim():
    a, b = TurboReferences(**CONFIG), TurboReferences(**CONFIG)
    a.append(0, _tokens(seed=1), _tokens(seed=2))
    b.append(0, _tokens(seed=3), _tokens(seed=4))
    assert a._codecs[0] is b._codecs[0] and a._codecs[1] is b._codecs[1]
    other = TurboReferences(**CONFIG)
    other.append(0, _tokens(dim=64), _tokens(dim=64))
    assert other._codecs[0] is not a._codecs[0]


def test_fractional_widths_are_built_per_reference_from_its_tokens():
    config = dict(bits=4.0, seed=0, key_bits=2.5, value_bits=None)
    keys = mx.array(_tokens(dim=80)[None])
    first, _ = reference_codecs(config, keys, keys)
    second, _ = reference_codecs(config, keys, keys)
    assert isinstance(first, _SplitCodec) and first is not second


def test_use_leaves_the_shared_codecs_unchanged():
    refs = TurboReferences(**CONFIG)
    refs.new(0)
    refs.append(0, _tokens(), _tokens(seed=5))
    before = [(_arrays(c), set(vars(c))) for c in refs._codecs]
    for step in range(3):
        refs.append(0, _tokens(seed=10 + step), _tokens(seed=20 + step))
        keys, values = refs.dequantized(0)
        # A cache's tokens off by far more than rounding: judged, not admitted.
        refs.admit_rounding_row(0, keys + 1.0, values)
    refs.admit_rounding(0, "values", values + 1e-3, content_tolerance(values))
    assert refs._admissible is not None  # the admissible-code models read the codecs too
    for codec, (arrays, names) in zip(refs._codecs, before):
        assert set(vars(codec)) == names
        for name, value in _arrays(codec).items():
            np.testing.assert_array_equal(value, arrays[name], err_msg=name)


def test_writes_into_mlx_vlms_tables_do_not_reach_them():
    codecs = TurboReferences(**CONFIG)
    codecs.append(0, _tokens(), _tokens())
    key_codec = codecs._codecs[0]
    table = _codebook(96, 3)  # what every codec mlx-vlm builds at (96, 3) holds
    saved = np.array(table)
    try:
        table[0] = 123.0  # a target writing into its codec's codebook
        assert float(np.array(table)[0]) == 123.0
        np.testing.assert_array_equal(np.array(key_codec.codebook), saved)
    finally:
        table[0] = float(saved[0])


def test_the_target_builds_its_own():
    world = World(tqbatch.BatchTurboQuantKVCache, **CONFIG, head_dim=96)
    for op in (
        {"op": "merge", "lengths": [3, 1], "kv_seed": 7},
        {"op": "update", "tokens": 2, "kv_seed": 8},
    ):
        world.apply(op)
        world.check()
    target = (world.target.key_codec, world.target.value_codec)
    for mine, theirs in zip(world.refs._codecs, target):
        assert mine is not theirs
        shared = [k for k, v in vars(mine).items() if any(v is w for w in vars(theirs).values())]
        assert not [k for k in shared if isinstance(vars(mine)[k], mx.array)], shared
