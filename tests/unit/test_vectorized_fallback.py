"""The harness's vectorized fallback (packing, unpacking, code search) against mlx-vlm's
own, bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_vlm import turboquant
from mlx_vlm.turboquant import TurboQuantKVCache, _TurboQuantMSECodec

from tqbatch.testing.oracles.vectorized_fallback import (
    pack_lowbit,
    quantize_unit,
    unpack_lowbit,
    vectorized_fallback,
)

# mlx-vlm's fallback loops, held before any test could leave a replacement behind.
MLX_VLM_PACK, MLX_VLM_UNPACK = turboquant._pack_lowbit, turboquant._unpack_lowbit
MLX_VLM_QUANTIZE_UNIT = _TurboQuantMSECodec._quantize_unit

pytestmark = pytest.mark.skipif(
    turboquant._metal_available(), reason="mlx-vlm packs with its Metal kernels here"
)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(1, 8),
    length=st.integers(1, 130),
    rows=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_pack_equals_mlx_vlm(bits, length, rows, seed):
    rng = np.random.default_rng(seed)
    codes = mx.array(rng.integers(0, 2**bits, (rows, 2, length)).astype(np.uint32))
    want, got = MLX_VLM_PACK(codes, bits), pack_lowbit(codes, bits)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(np.array(got), np.array(want))


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), length=st.integers(1, 130), seed=st.integers(0, 2**16))
def test_unpack_equals_mlx_vlm_on_any_words(bits, length, seed):
    """Any words, not only packed codes: bits past the codes are ignored the same way."""
    width = (length * bits + 31) // 32
    rng = np.random.default_rng(seed)
    words = mx.array(rng.integers(0, 2**32, (3, width), dtype=np.uint64).astype(np.uint32))
    want, got = MLX_VLM_UNPACK(words, bits, length), unpack_lowbit(words, bits, length)
    assert got.dtype == want.dtype
    assert np.array_equal(np.array(got), np.array(want))


def test_zero_bits_is_empty():
    codes = mx.zeros((2, 5), dtype=mx.uint32)
    assert pack_lowbit(codes, 0).shape == MLX_VLM_PACK(codes, 0).shape == (2, 0)
    assert unpack_lowbit(codes, 0, 5).shape == MLX_VLM_UNPACK(codes, 0, 5).shape == (2, 0)


def test_a_wrong_packing_is_seen():
    """The comparison above can fail: one bit of the stream off is a different word."""
    codes = mx.array(np.arange(16, dtype=np.uint32)[None] % 8)
    shifted = pack_lowbit(codes, 3) << 1
    assert not np.array_equal(np.array(shifted), np.array(MLX_VLM_PACK(codes, 3)))


@pytest.mark.parametrize("bits", [2, 3.5, 4, 8])
@pytest.mark.parametrize("tokens", [1, 7])
def test_a_member_written_inside_is_the_same_cache(bits, tokens):
    """A single-request cache prefilled inside the block holds the same state, bytes and
    offset, and reads back the same tokens, as one prefilled by mlx-vlm's own loops."""
    rng = np.random.default_rng(tokens)
    keys = mx.array(rng.standard_normal((1, 2, tokens, 64)).astype(np.float32))
    values = mx.array(rng.standard_normal((1, 2, tokens, 64)).astype(np.float32))
    plain, fast = TurboQuantKVCache(bits=bits, seed=3), TurboQuantKVCache(bits=bits, seed=3)
    plain.update_and_fetch(keys, values)
    with vectorized_fallback():
        fast.update_and_fetch(keys, values)
        read = fast.dequantize()
    assert fast.offset == plain.offset and fast.meta_state == plain.meta_state
    got, want = tree_flatten(fast.state), tree_flatten(plain.state)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
    for a, b in zip(read, plain.dequantize()):
        assert np.array_equal(np.array(a), np.array(b))


def test_only_inside_the_block():
    """mlx-vlm's own functions are back after the block, also when it raises."""
    with pytest.raises(RuntimeError), vectorized_fallback():
        assert turboquant._pack_lowbit is not MLX_VLM_PACK
        assert _TurboQuantMSECodec._quantize_unit is not MLX_VLM_QUANTIZE_UNIT
        raise RuntimeError
    assert turboquant._pack_lowbit is MLX_VLM_PACK
    assert turboquant._unpack_lowbit is MLX_VLM_UNPACK
    assert _TurboQuantMSECodec._quantize_unit is MLX_VLM_QUANTIZE_UNIT


def test_a_short_packed_row_goes_to_mlx_vlm():
    """Words too few for the codes asked: whatever mlx-vlm's loop makes of them."""
    seen = []

    def spy(packed, bits, length):
        seen.append((packed.shape[-1], bits, length))
        return mx.zeros((*packed.shape[:-1], length), dtype=mx.uint32)

    turboquant._unpack_lowbit = spy
    try:
        with vectorized_fallback():
            turboquant._unpack_lowbit(mx.zeros((1, 1), dtype=mx.uint32), 4, 64)
            turboquant._unpack_lowbit(mx.zeros((1, 8), dtype=mx.uint32), 4, 64)
    finally:
        turboquant._unpack_lowbit = MLX_VLM_UNPACK
    assert seen == [(1, 4, 64)]


@pytest.mark.parametrize("bits", range(0, 9))
@pytest.mark.parametrize("dim", [64, 80])  # a Hadamard rotation, a dense one
def test_the_code_search_writes_mlx_vlm_codes(bits, dim):
    """Unit vectors, a zero one, and one whose coordinates rotate to about the codebook's
    midpoints (the search's boundary cases): mlx-vlm's packed codes."""
    codec = _TurboQuantMSECodec(dim, bits, seed=5)
    rng = np.random.default_rng(bits * 100 + dim)
    x = rng.standard_normal((12, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    x[0] = 0.0
    unit = mx.array(x)
    if bits:  # rotated coordinates exactly on midpoints, rotated back
        mids = np.array(codec._midpoints)
        on = np.resize(mids, (dim,)).astype(np.float32)
        unit = mx.concatenate([unit, codec._rotate_inverse(mx.array(on))[None]], axis=0)
    got, want = quantize_unit(codec, unit), MLX_VLM_QUANTIZE_UNIT(codec, unit)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.array(got), np.array(want))
