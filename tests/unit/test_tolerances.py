"""Meta-tests of the derived tolerances: sound on real route differences, and informative.

Sound: two routes mlx-vlm really takes over the same packed codes (its
masked decode path and dequantize + fused SDPA; batched and single-row
dequantize) stay inside the bound. Informative: the smallest bugs the checks
exist for (one hidden token, one attended padding slot, one flipped code)
land outside it, at float32 and at TF32 where the issue is claimed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.testing.generation import POISON
from tqbatch.testing.numpy_model import causal_mask
from tqbatch.testing.tolerances import attention_tolerance, content_tolerance

CASES = [(bits, d, t) for bits in (2.0, 4.0, 8.0) for d in (64, 128) for t in (1, 9, 60)]


def _filled(bits, d, t, seed=0, heads=2):
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((1, heads, t, d)).astype(np.float32) for _ in range(2))
    cache = TurboQuantKVCache(bits=bits, seed=seed)
    ks, vs = cache.update_and_fetch(mx.array(k), mx.array(v))
    dk, dv = (np.array(x[0]) for x in cache.dequantize())
    return cache, ks, vs, dk, dv, rng


@pytest.mark.parametrize("bits,d,t", CASES)
def test_attention_routes_stay_inside_the_bound(bits, d, t):
    cache, ks, vs, dk, dv, rng = _filled(bits, d, t)
    q = rng.standard_normal((1, 4, 1, d)).astype(np.float32)
    mask = causal_mask(1, t - 1, [0])
    # Route 1: mlx-vlm's TurboQuant path with a mask (rotated query over codes).
    decode = np.array(
        scaled_dot_product_attention(
            mx.array(q), ks, vs, cache=cache, scale=d**-0.5, mask=mx.array(mask)
        )
    )[0]
    # Route 2: dequantize, then MLX's fused SDPA.
    fused = np.array(
        mx.fast.scaled_dot_product_attention(
            mx.array(q), mx.array(dk[None]), mx.array(dv[None]), scale=d**-0.5, mask=None
        )
    )[0]
    tol = attention_tolerance(q[0], dk, dv, mask[0, 0], d**-0.5)
    assert np.all(np.abs(decode - fused) <= tol)


@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_attending_one_padding_slot_is_outside_the_bound(precision):
    _, _, _, dk, dv, rng = _filled(4.0, 64, 60)
    q = rng.standard_normal((4, 1, 64))
    mask = np.ones((1, 60), dtype=bool)
    right = _attend(q, dk, dv, mask)
    # One extra slot of padding, written by the harness at POISON scale.
    pk = np.concatenate([dk, POISON * rng.standard_normal((2, 1, 64))], axis=1)
    pv = np.concatenate([dv, POISON * rng.standard_normal((2, 1, 64))], axis=1)
    wrong = _attend(q, pk, pv, np.ones((1, 61), dtype=bool))
    tol = attention_tolerance(q, dk, dv, mask, 64**-0.5, precision=precision)
    assert np.any(np.abs(wrong - right) > tol)


def test_hiding_one_valid_token_is_outside_the_float32_bound():
    _, _, _, dk, dv, rng = _filled(4.0, 64, 60)
    q = rng.standard_normal((4, 1, 64))
    mask = np.ones((1, 60), dtype=bool)
    hidden = mask.copy()
    hidden[0, 17] = False
    tol = attention_tolerance(q, dk, dv, mask, 64**-0.5, precision="float32")
    assert np.any(np.abs(_attend(q, dk, dv, hidden) - _attend(q, dk, dv, mask)) > tol)


@pytest.mark.parametrize("d", [64, 128])
def test_batched_and_single_dequantize_stay_inside_the_bound(d):
    rng = np.random.default_rng(d)
    k = rng.standard_normal((3, 2, 7, d)).astype(np.float32)
    batch = TurboQuantKVCache(bits=4.0, seed=1)
    batch.update_and_fetch(mx.array(k), mx.array(k))
    together = np.array(batch.dequantize()[0])
    for b in range(3):
        alone = TurboQuantKVCache(bits=4.0, seed=1)
        alone.update_and_fetch(mx.array(k[b : b + 1]), mx.array(k[b : b + 1]))
        want = np.array(alone.dequantize()[0])[0]
        assert np.all(np.abs(together[b] - want) <= content_tolerance(want))


def _attend(q, k, v, mask):
    """Float64 attention of one request: q (Hq, N, D), k/v (Hkv, T, D), mask (N, T)."""
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = np.einsum("hnd,htd->hnt", q, k) * q.shape[-1] ** -0.5
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hnt,htd->hnd", p / p.sum(-1, keepdims=True), v)
