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

from tqbatch.testing.oracles.generation import POISON
from tqbatch.testing.oracles.numpy_model import causal_mask
from tqbatch.testing.oracles.tolerances import (
    attention_tolerance,
    content_tolerance,
    fast_exp_error,
)

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


def _softmax_output(scores, values, relative_exp_error):
    """Attention output with each exp(s_j - max) off by ``relative_exp_error[j]`` (relative)."""
    x = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(x) * (1.0 + relative_exp_error)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hnt,htd->hnd", weights, values)


@pytest.mark.parametrize("query_scale", [1e-7, 1.0, 3.0])
def test_metal_fast_math_exp_stays_inside_its_term(query_scale):
    """exp off by its whole fast-math bound, signs set to move the output most.

    The move stays inside the exp term alone (2 x one route's worst case), and
    reaches about half of it (the other route's half): the term is sized by
    the derivation, not hidden in the score or value terms' slack.
    """
    rng = np.random.default_rng(5)
    d, t = 64, 40
    q = rng.standard_normal((2, 1, d)) * query_scale
    k = rng.standard_normal((2, t, d))
    v = rng.standard_normal((2, t, d)) * 8.0
    mask = np.ones((1, t), dtype=bool)
    scale = d**-0.5
    scores = scale * np.einsum("hnd,htd->hnt", q, k)
    exact = _softmax_output(scores, v, 0.0)
    bound = fast_exp_error(scores - scores.max(axis=-1, keepdims=True))
    # Raise the weights of values above the output in coordinate 0, lower the rest.
    sign = np.where(v[:, None, :, 0] > exact[:, :, None, 0], 1.0, -1.0)
    moved = np.abs(_softmax_output(scores, v, sign * bound) - exact)[..., 0]
    deviation = np.abs(v[:, None, :, 0] - exact[:, :, None, 0])
    exp_term = 2.0 * np.einsum("hnt,hnt->hn", _weights(scores) * bound, deviation)
    assert np.all(moved <= exp_term)
    assert np.all(moved >= 0.4 * exp_term)
    tol = attention_tolerance(q, k, v, mask, scale, precision="float32")[..., 0]
    assert np.all(moved <= tol)


def test_fast_exp_error_follows_the_metal_specification():
    """3 ulp at 0, 3 + floor(|2x|) ulp elsewhere, nothing for a masked (-inf) argument."""
    got = fast_exp_error(np.array([0.0, -0.4, -0.5, -10.25, -np.inf]))
    assert np.array_equal(got / 2.0**-23, [3.0, 3.0, 4.0, 23.0, 0.0])


def _weights(scores):
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return w / w.sum(axis=-1, keepdims=True)
