"""tqbatch's vectorized codec (``tqbatch._codec``) against mlx-vlm's.

Quantizing must write the very bits mlx-vlm's codec writes (a row must hold
what a per-request ``TurboQuantKVCache`` holds), dequantizing must give the
very floats, and attention over the packed state must agree with mlx-vlm's
decode path and with dequantize + SDPA within the rounding bound the harness
derives (``tqbatch.testing.oracles.tolerances.attention_tolerance``).
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import create_causal_mask
from mlx_vlm.turboquant import (
    TurboQuantKVCache,
    _pack_lowbit,
    _TurboQuantMSECodec,
    _unpack_lowbit,
)

from tqbatch import _codec
from tqbatch._devices import metal_kernels_here
from tqbatch.testing.oracles.reference import to_numpy
from tqbatch.testing.oracles.tolerances import attention_tolerance, excess_ratios

BITS = range(1, 9)
# Powers of two use the Hadamard rotation, the others a dense one.
HEAD_DIMS = [32, 64, 80, 96, 128, 256]

pytestmark = pytest.mark.skipif(
    metal_kernels_here(),
    reason="on a Mac's GPU lane tqbatch keeps mlx-vlm's kernels (covers() is False)",
)


@pytest.mark.parametrize(("bits", "dim"), list(itertools.product(BITS, HEAD_DIMS)))
def test_quantize_writes_mlx_vlm_bits_and_dequantize_its_floats(bits, dim, monkeypatch):
    if (bits + dim) % 2:  # half the grid through the binary search (large writes)
        monkeypatch.setattr(_codec, "_BROADCAST_LIMIT", 0)
    codec = _TurboQuantMSECodec(dim, bits, seed=7)
    assert _codec.covers(codec)
    rng = np.random.default_rng(bits * 1000 + dim)
    # Tokens of several scales, a zero token (norm below the epsilon) and
    # coordinates on midpoints are the boundary cases of the code search.
    x = rng.standard_normal((2, 2, 9, dim)) * rng.uniform(0.01, 20, (2, 2, 9, 1))
    x[0, 0, 0] = 0.0
    x = mx.array(x.astype(np.float32))
    want, got = codec.quantize(x), _codec.quantize(codec, x)
    assert np.array_equal(to_numpy(got.indices), to_numpy(want.indices))
    assert got.indices.dtype == want.indices.dtype == mx.uint32
    assert np.array_equal(to_numpy(got.norms), to_numpy(want.norms))
    assert got.norms.dtype == want.norms.dtype
    assert np.array_equal(
        to_numpy(_codec.dequantize(codec, want)), to_numpy(codec.dequantize(want))
    )


@pytest.mark.parametrize("search", ["broadcast", "binary"])
@pytest.mark.parametrize("bits", BITS)
def test_codes_on_a_midpoint_go_where_mlx_vlm_puts_them(bits, search, monkeypatch):
    """A rotated coordinate exactly on a midpoint (or the codebook's ends) gets mlx-vlm's code,
    by either search (small inputs compare with every midpoint, large ones bisect)."""
    if search == "binary":
        monkeypatch.setattr(_codec, "_BROADCAST_LIMIT", 0)
    codec = _TurboQuantMSECodec(64, bits, seed=0)
    mids = np.array(codec._midpoints)
    book = np.array(codec.codebook)
    edge = np.concatenate([mids, book, [-1.0, 1.0, 0.0]]).astype(np.float32)
    rotated = mx.array(np.resize(edge, (3, 64)))
    want = sum((rotated > codec._midpoints[m]).astype(mx.uint32) for m in range(len(mids)))
    assert np.array_equal(to_numpy(_codec._codes(codec, rotated)), to_numpy(want))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    bits=st.integers(1, 8),
    dim=st.sampled_from([1, 3, 32, 33, 80, 96, 128]),
    data=st.data(),
)
def test_pack_and_unpack_match_mlx_vlm(bits, dim, data):
    codes = data.draw(
        st.lists(st.integers(0, 2**bits - 1), min_size=2 * dim, max_size=2 * dim), label="codes"
    )
    codes = mx.array(np.array(codes, dtype=np.uint32).reshape(2, dim))
    packed = _codec.pack(codes, bits)
    assert np.array_equal(to_numpy(packed), to_numpy(_pack_lowbit(codes, bits)))
    assert np.array_equal(to_numpy(_codec.unpack(packed, bits, dim)), to_numpy(codes))
    assert np.array_equal(
        to_numpy(_codec.unpack(packed, bits, dim)), to_numpy(_unpack_lowbit(packed, bits, dim))
    )


def test_fractional_side_bits_stay_on_mlx_vlm():
    """bits=3.5 means 3-bit keys and 4-bit values (covered); key_bits=2.5 is a split codec."""
    cache = TurboQuantKVCache(bits=4, key_bits=2.5, seed=0)
    kv = mx.array(np.random.default_rng(0).standard_normal((1, 1, 2, 64)).astype(np.float32))
    cache.update_and_fetch(kv, kv)
    assert not _codec.covers(cache.key_codec) and _codec.covers(cache.value_codec)
    state = _codec.quantize(cache.key_codec, kv)  # falls back to the codec's own method
    assert type(state) is type(cache.key_codec.quantize(kv))
    assert _codec.attend(kv, state, state, cache.key_codec, cache.key_codec, 1.0) is None


# (key bits, value bits, head_dim, B, query heads, kv heads, queries, tokens)
ATTENTION_CASES = [
    (4, 4, 128, 2, 4, 2, 1, 37),
    (2, 8, 64, 3, 2, 2, 5, 20),
    (3, 3, 80, 1, 4, 1, 1, 300),
    (8, 8, 96, 2, 2, 2, 3, 9),
    (1, 4, 32, 1, 1, 1, 1, 1),
    (6, 5, 256, 2, 2, 1, 2, 64),
]


def _bool(mask, B, L, T):
    if mask is None:
        return np.ones((B, L, T), bool)
    if isinstance(mask, str):
        return np.broadcast_to(np.tril(np.ones((L, T), bool), T - L), (B, L, T))
    m = to_numpy(mask)
    m = m if m.dtype == np.bool_ else m > -1.0
    return np.broadcast_to(m[:, 0], (B, L, T))


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_attention_matches_dequantize_sdpa_and_mlx_vlm(case):
    kb, vb, D, B, hq, hkv, L, T = case
    rng = np.random.default_rng(sum(case))
    key_codec, value_codec = _TurboQuantMSECodec(D, kb, seed=0), _TurboQuantMSECodec(D, vb, seed=1)
    k = mx.array(rng.standard_normal((B, hkv, T, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, hkv, T, D)).astype(np.float32))
    q = rng.standard_normal((B, hq, L, D)).astype(np.float32)
    ks, vs = _codec.quantize(key_codec, k), _codec.quantize(value_codec, v)
    dk, dv = _codec.dequantize(key_codec, ks), _codec.dequantize(value_codec, vs)
    padding = mx.array(rng.integers(0, min(3, T - L + 1), B))
    causal = create_causal_mask(L, offset=T - L, left_padding=padding)
    masks = {"none": None, "causal": "causal", "bool": causal}
    masks["additive"] = mx.where(causal, 0.0, -1e9)
    single = TurboQuantKVCache(bits=kb, seed=0)
    single.key_codec, single.value_codec = key_codec, value_codec
    scale = D**-0.5
    for name, mask in masks.items():
        got = to_numpy(_codec.attend(mx.array(q), ks, vs, key_codec, value_codec, scale, mask))
        routes = {
            "dequantize + SDPA": mx.fast.scaled_dot_product_attention(
                mx.array(q), dk, dv, scale=scale, mask=mask
            )
        }
        if L == 1:
            routes["mlx-vlm decode"] = single.decode_attention(mx.array(q), ks, vs, scale, mask)
        allowed = _bool(mask, B, L, T)
        for b in range(B):
            # The harness's derived bound for two float32 routes over the same
            # codes (~1e-6 here); a wrong code, token or mask moves outputs by >1e-2.
            tol = attention_tolerance(q[b], to_numpy(dk[b]), to_numpy(dv[b]), allowed[b], scale)
            for route, want in routes.items():
                ratio = excess_ratios(got[b], to_numpy(want)[b], tol)
                assert ratio.max() <= 1.0, (name, route, b, float(ratio.max()))


def test_a_lookup_table_is_built_once_per_codebook_and_follows_its_values():
    """Codecs of one codebook share its table; a codebook with other values (a
    target that changed its codec's) gets a table of its own, and reads back
    through it."""
    first, second = (_TurboQuantMSECodec(64, 4, seed=s) for s in (1, 2))
    state = first.quantize(mx.array(np.random.default_rng(0).standard_normal((1, 2, 3, 64))))
    for codec in (first, second):
        _codec.dequantize(codec, state)
    assert first._tqbatch_table_16 is second._tqbatch_table_16

    changed = _TurboQuantMSECodec(64, 4, seed=1)
    changed.codebook = changed.codebook * 2
    got = to_numpy(_codec.dequantize(changed, state))
    assert changed._tqbatch_table_16 is not first._tqbatch_table_16
    np.testing.assert_array_equal(got, 2 * to_numpy(_codec.dequantize(first, state)))
