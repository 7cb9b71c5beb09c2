"""The references' round trip is mlx-vlm's ``dequantize(quantize(x))``, bit for bit.

``tqbatch.testing.oracles.codec_round_trip`` repeats the steps of mlx-vlm's plain
codec without packing the codes; here it is compared with the codec's own
methods at every width and head dim the machine draws (and 1 and 5 bits),
on tokens of one and many positions, zero tokens and huge ones, and with a
split codec; its midpoint count with mlx-vlm's sum over the midpoints at
and next to every midpoint.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.turboquant import _build_codec, _SplitCodec, _TurboQuantMSECodec

from tqbatch.testing.oracles.code_search import midpoints_below
from tqbatch.testing.oracles.codec_round_trip import round_trip


def _tokens(dim: int, positions: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 2, positions, dim)).astype(np.float32)
    x[0, 0, 0] = 0.0  # a zero token: the norm's lower bound
    if positions > 2:
        x[0, 1, 1] *= 1e4
        x[0, 1, 2] *= 1e-4
    return mx.array(x)


def _mlx_vlm(codec, tokens: mx.array) -> np.ndarray:
    return np.array(codec.dequantize(codec.quantize(tokens)).astype(mx.float32))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dim", [32, 64, 80, 96, 128, 256])
def test_equals_the_codecs_own_round_trip(bits, dim):
    for seed, positions in ((0, 1), (1, 5), (2, 40)):
        codec = _TurboQuantMSECodec(dim, bits, seed)
        tokens = _tokens(dim, positions, seed)
        got = np.array(round_trip(codec, tokens).astype(mx.float32))
        np.testing.assert_array_equal(got, _mlx_vlm(codec, tokens), err_msg=f"seed {seed}")


@pytest.mark.parametrize(("bits", "dim"), [(2.5, 80), (3.5, 64), (1.5, 128)])
def test_equals_a_split_codecs_own_round_trip(bits, dim):
    tokens = _tokens(dim, 6, 3)
    codec = _build_codec(tokens, bits, mode="mse", seed=1)
    assert isinstance(codec, _SplitCodec)
    got = np.array(round_trip(codec, tokens).astype(mx.float32))
    np.testing.assert_array_equal(got, _mlx_vlm(codec, tokens))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_midpoint_count_at_and_beside_every_midpoint(bits):
    mids = _TurboQuantMSECodec(64, bits, 0)._midpoints
    m = np.array(mids)
    x = np.concatenate(
        [m, np.nextafter(m, np.inf), np.nextafter(m, -np.inf), [np.nan, np.inf, -np.inf, 0.0]]
    ).astype(np.float32)
    x = mx.array(x)
    want = mx.zeros(x.shape, dtype=mx.uint32)
    for k in range(mids.shape[0]):  # mlx-vlm's _quantize_unit
        want = want + (x > mids[k]).astype(mx.uint32)
    np.testing.assert_array_equal(np.array(midpoints_below(mids, x)), np.array(want))
