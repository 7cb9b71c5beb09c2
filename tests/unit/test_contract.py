"""Every point of the batch-cache contract, each checked in lockstep with mlx-lm's
BatchKVCache (geometry) and per-request TurboQuantKVCache references (content)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.turboquant import TurboQuantKVCache

from .support import (
    Impl,
    Lockstep,
    Request,
    assert_attention_matches,
    leaves,
    normal,
    packed_rows_equal,
)

# ---------------------------------------------------------------- constructor


@pytest.mark.parametrize("left_padding", [[0], [0, 0], [2, 0, 5], [1, 1, 1, 1]])
def test_constructor_is_an_empty_batch(left_padding):
    ls = Lockstep.new(left_padding, bits=3.5, seed=7)
    tq = ls.tq
    assert isinstance(tq, TurboQuantKVCache)
    assert tq.empty() and tq.size() == 0 and tq.nbytes == 0
    assert tq.bits == 3.5 and tq.seed == 7
    assert tq.left_padding.tolist() == left_padding
    assert tq.offset.tolist() == [-p for p in left_padding]
    ls.check_geometry()


def test_constructor_defaults():
    tq = Impl([0, 3])
    assert (tq.bits, tq.seed) == (4.0, 0)


def test_constructor_copies_left_padding():
    padding = mx.array([1, 2])
    tq = Impl(padding)
    padding[0] = 9
    assert tq.left_padding.tolist() == [1, 2]


# ---------------------------------------------------------------- merge


@pytest.mark.parametrize(
    "lengths",
    [[5], [5, 3], [3, 5, 1], [4, 0, 2], [0, 6], [0, 0, 0], [0], [2, 2, 2, 2]],
    ids=str,
)
def test_merge(lengths, rng):
    ls = Lockstep.merge(lengths, rng)
    ls.check()
    assert ls.tq.empty() == (max(lengths) == 0)
    # and the merged batch goes on in lockstep
    assert_attention_matches(ls.attend(rng, 1))
    ls.check()


def test_merge_leaves_members_untouched(rng):
    members = []
    for n in (4, 2):
        c = TurboQuantKVCache(bits=4.0, seed=0)
        c.update_and_fetch(normal(rng, (1, 2, n, 64)), normal(rng, (1, 2, n, 64)))
        members.append(c)
    offsets = [c.offset for c in members]
    before = [[np.array(a) for a in leaves(c.state)] for c in members]
    batch = Impl.merge(members)
    batch.update_and_fetch(normal(rng, (2, 2, 3, 64)), normal(rng, (2, 2, 3, 64)))
    batch.trim(2)
    batch.update_and_fetch(normal(rng, (2, 2, 1, 64)), normal(rng, (2, 2, 1, 64)))
    assert [c.offset for c in members] == offsets
    for c, old in zip(members, before):
        for a, b in zip(leaves(c.state), old):
            np.testing.assert_array_equal(np.array(a), b)


def test_merge_of_trimmed_member_uses_its_offset_not_its_capacity(rng):
    member = TurboQuantKVCache(bits=4.0, seed=0)
    req = Request.empty()
    k, v = normal(rng, (1, 2, 6, 64)), normal(rng, (1, 2, 6, 64))
    member.update_and_fetch(k, v)
    member.trim(2)
    req.append(np.array(k[0, :, :4]), np.array(v[0, :, :4]))
    batch = Impl.merge([member])
    assert batch.size() == 4 and batch.offset.tolist() == [4]
    ref = req.reference(4.0, 0)
    assert packed_rows_equal(batch.state[0], 0, 0, 4, ref.state[0])


# ---------------------------------------------------------------- update_and_fetch


@pytest.mark.parametrize("tokens", [1, 2, 7])
@pytest.mark.parametrize("lengths", [[3], [3, 1, 0]], ids=str)
def test_update_and_fetch(lengths, tokens, rng):
    ls = Lockstep.merge(lengths, rng)
    keys, values = ls.update(rng, tokens)
    ls.check()
    # What it returns is what attention needs: every written slot, in a form
    # mlx-vlm's dequantize and attention accept.
    size = ls.tq.size()
    assert keys.shape[2] == size and values.shape[2] == size
    dk, dv = ls.tq.dequantize(keys, values)
    full_k, full_v = ls.tq.dequantize()
    assert bool(mx.array_equal(dk, full_k).item()) and bool(mx.array_equal(dv, full_v).item())
    # a second write, of another length, lands right after the first
    ls.update(rng, 2)
    ls.check()


def test_update_on_an_empty_left_padded_batch(rng):
    ls = Lockstep.new([2, 0, 4])
    ls.update(rng, 5)
    ls.check()
    ls.update(rng, 1)
    ls.check()


# ---------------------------------------------------------------- make_mask


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("return_array", [False, True])
@pytest.mark.parametrize("window_size", [None, 3])
def test_make_mask_matches_batch_kv_cache(n, return_array, window_size, rng):
    ls = Lockstep.merge([6, 2, 0], rng)
    ls.update(rng, 2)
    for cache_state in ("filled", "empty"):
        if cache_state == "empty":
            ls = Lockstep.new([0, 3])
        got = ls.tq.make_mask(n, return_array=return_array, window_size=window_size)
        want = ls.dense.make_mask(n, return_array=return_array, window_size=window_size)
        assert got.shape == want.shape == (ls.batch, 1, n, ls.dense.size() + n)
        assert bool(mx.array_equal(got, want).item())


# ---------------------------------------------------------------- prepare / finalize


@pytest.mark.parametrize("left_padding", [[0, 2, 5], [3]], ids=str)
def test_prepare_left_padding(left_padding, rng):
    ls = Lockstep.new([0] * len(left_padding))
    ls.prepare(left_padding=left_padding)
    ls.check_geometry()
    assert_attention_matches(ls.attend(rng, 7))
    ls.check()
    assert_attention_matches(ls.attend(rng, 1))
    ls.check()


def test_prepare_left_padding_adds_to_constructor_padding(rng):
    ls = Lockstep.new([1, 0])
    ls.prepare(left_padding=[2, 3])
    assert ls.tq.left_padding.tolist() == [3, 3]
    ls.update(rng, 6)
    ls.check()


@pytest.mark.parametrize("right_padding", [[0, 2, 4], [3], [0, 0]], ids=str)
def test_prepare_right_padding_then_finalize(right_padding, rng):
    ls = Lockstep.new([0] * len(right_padding))
    ls.prepare(right_padding=right_padding)
    assert_attention_matches(ls.attend(rng, 6))
    ls.finalize()
    ls.check()
    assert_attention_matches(ls.attend(rng, 1))
    ls.check()


def test_prepare_accepts_lengths(rng):
    ls = Lockstep.new([0, 0])
    ls.tq.prepare(lengths=[4, 2], right_padding=[0, 2])
    ls.dense.prepare(lengths=[4, 2], right_padding=[0, 2])
    ls.pending_right = [0, 2]
    ls.update(rng, 4)
    ls.finalize()
    ls.check()


def test_finalize_without_pending_padding_is_a_no_op(rng):
    ls = Lockstep.merge([3, 1], rng)
    before = [np.array(a) for a in leaves(ls.tq.state[:2])]
    ls.finalize()
    ls.check()
    for a, b in zip(leaves(ls.tq.state[:2]), before):
        np.testing.assert_array_equal(np.array(a), b)


def test_right_padded_prefill_on_a_batch_with_history(rng):
    """Right padding declared on a non-empty batch (a second prefill chunk):
    finalize rolls the row's history along with the new tokens."""
    ls = Lockstep.merge([3, 3], rng)
    ls.prepare(right_padding=[2, 0])
    ls.update(rng, 4)
    ls.finalize()
    ls.check()
    assert_attention_matches(ls.attend(rng, 1))
    ls.check()


# ---------------------------------------------------------------- filter / extend / extract


@pytest.mark.parametrize("indices", [[0], [2], [1, 2], [2, 0], [0, 1, 2], [2, 1, 0]], ids=str)
def test_filter(indices, rng):
    ls = Lockstep.merge([6, 2, 4], rng)
    ls.update(rng, 1)
    ls.filter(indices)
    ls.check()
    assert_attention_matches(ls.attend(rng, 2))
    ls.check()


@pytest.mark.parametrize(
    "left,right",
    [([5, 2], [3]), ([2], [6, 1]), ([4], [4]), ([0, 3], [2]), ([3], [0, 0]), ([0], [0])],
    ids=str,
)
def test_extend(left, right, rng):
    """Either side may be longer, or empty (all-zero lengths), or both empty."""
    a = Lockstep.merge(left, rng)
    b = Lockstep.merge(right, rng)
    a.extend(b)
    a.check()
    assert_attention_matches(a.attend(rng, 1))
    a.check()


def test_extend_with_new_empty_batches(rng):
    a = Lockstep.new([1, 0])
    b = Lockstep.new([2])
    a.extend(b)
    a.check_geometry()
    a.update(rng, 4)
    a.check()


def test_extend_after_decode_on_both_sides(rng):
    a = Lockstep.merge([4, 1], rng)
    a.update(rng, 1)
    b = Lockstep.merge([2], rng)
    b.update(rng, 3)
    a.extend(b)
    a.check()
    assert_attention_matches(a.attend(rng, 1, q_heads=4))
    a.check()


@pytest.mark.parametrize("indices", [[0, 1], [2], [2, 0]], ids=str)
def test_filter_while_right_padding_is_pending(indices, rng):
    """A request leaves between a right-padded prefill and finalize(): the
    survivors' pending padding must follow them."""
    ls = Lockstep.new([0, 0, 0])
    ls.prepare(right_padding=[2, 1, 3])
    ls.update(rng, 6)
    ls.filter(indices)
    # mlx-lm's BatchKVCache.filter leaves its pending right padding unfiltered
    # (it would roll the wrong rows): the oracle gets it filtered by hand.
    ls.dense._right_padding = mx.array([[2, 1, 3][i] for i in indices])
    ls.finalize()
    ls.check()
    assert_attention_matches(ls.attend(rng, 1))
    ls.check()


@pytest.mark.parametrize("index", [0, 1, 2])
def test_extract(index, rng):
    ls = Lockstep.merge([5, 2, 3], rng)
    ls.update(rng, 2)
    before = [np.array(a) for a in leaves(ls.tq.state)]
    single = ls.tq.extract(index)
    # A single-request mlx-vlm cache that per-request batchers can merge again.
    assert isinstance(single, TurboQuantKVCache)
    assert not hasattr(single, "left_padding")
    rebatched = type(single).merge([single])
    assert rebatched.offset.tolist() == [len(ls.requests[index])]
    req = ls.requests[index]
    assert single.offset == len(req) and single.size() == len(req)
    ref = req.reference(4.0, 0)
    for got, want in zip(leaves(single.state), leaves(ref.state)):
        assert bool(mx.array_equal(got, want).item())
    # the batch is untouched, and the extracted cache lives on its own
    ls.check()
    k, v = normal(rng, (1, 2, 1, 64)), normal(rng, (1, 2, 1, 64))
    single.update_and_fetch(k, v)
    ref.update_and_fetch(k, v)
    for got, want in zip(leaves(single.state), leaves(ref.state)):
        assert bool(mx.array_equal(got, want).item())
    for a, b in zip(leaves(ls.tq.state), before):
        np.testing.assert_array_equal(np.array(a), b)


def test_extract_of_an_empty_row(rng):
    ls = Lockstep.merge([3, 0], rng)
    single = ls.tq.extract(1)
    assert single.empty() and single.offset == 0


def test_extract_with_pending_right_padding_excludes_padding(rng):
    ls = Lockstep.new([0, 0])
    ls.prepare(right_padding=[2, 0])
    ls.update(rng, 5)
    single = ls.tq.extract(0)
    ref = ls.requests[0].reference(4.0, 0)
    assert single.offset == 3
    for got, want in zip(leaves(single.state), leaves(ref.state)):
        assert bool(mx.array_equal(got, want).item())


# ---------------------------------------------------------------- trim


@pytest.mark.parametrize("n", [0, 1, 3, 100])
def test_trim(n, rng):
    ls = Lockstep.merge([4, 2, 6], rng)
    ls.update(rng, 3)
    size = ls.tq.size()
    assert ls.trim(n) == min(n, size)
    ls.check_geometry()
    if n <= 2:  # no row trimmed below zero: content still checkable
        ls.check_rows()
        assert_attention_matches(ls.attend(rng, 1))
        ls.check()


def test_is_trimmable():
    assert Impl([0, 0]).is_trimmable() is True


# ------------------------------------------------------- size / empty / nbytes / dequantize


def test_size_empty_nbytes_dequantize(rng):
    ls = Lockstep.new([1, 0])
    tq = ls.tq
    assert tq.size() == 0 and tq.empty() and tq.nbytes == 0
    ls.update(rng, 4)
    assert type(tq.size()) is int and tq.size() == 4
    assert not tq.empty()
    keys, values = tq.dequantize()
    assert keys.shape == values.shape == (2, 2, 4, 64)
    assert keys.dtype == values.dtype == mx.float32
    # nbytes counts the packed buffers: at least the written slots
    written = sum(a.nbytes for a in leaves(tq.state[:2]))
    assert tq.nbytes >= written > 0
    # 4-bit MSE state per token and head: 64 * 4 / 8 bytes of indices + a float16 norm, K and V
    assert written == 2 * (2 * 2 * 4 * (64 * 4 // 8 + 2))


def test_dequantize_of_an_empty_cache_raises():
    with pytest.raises(ValueError, match="empty"):
        Impl([0]).dequantize()


def test_dequantize_with_unequal_key_and_value_bits(rng):
    ls = Lockstep.merge([3, 5], rng, bits=3.5)  # keys 3 bits, values 4 bits
    assert (ls.tq.key_bits, ls.tq.value_bits) == (3.0, 4.0)
    ls.update(rng, 2)
    ls.check()


# ---------------------------------------------------------------- state / meta_state


@pytest.mark.parametrize("pending", [False, True])
def test_state_and_meta_state_round_trip(pending, rng):
    ls = Lockstep.merge([5, 1, 3], rng, bits=3.5, seed=9)
    ls.update(rng, 1)
    if pending:
        ls.prepare(right_padding=[1, 0, 2])
        ls.update(rng, 3)
    ls.roundtrip()
    assert (ls.tq.bits, ls.tq.seed) == (3.5, 9)
    if pending:
        ls.finalize()
    ls.check()
    assert_attention_matches(ls.attend(rng, 1))
    ls.check()


def test_state_setter_on_an_existing_cache(rng):
    donor = Lockstep.merge([4, 2], rng)
    target = Impl([0, 0])
    target.state = donor.tq.state
    target.meta_state = donor.tq.meta_state
    donor.tq = target
    donor.check()


def test_round_trip_of_an_empty_cache():
    tq = Impl([2, 0], bits=3.0, seed=4)
    restored = Impl.from_state(tq.state, tq.meta_state)
    assert restored.empty() and restored.size() == 0
    assert restored.left_padding.tolist() == [2, 0] and restored.offset.tolist() == [-2, 0]
    assert (restored.bits, restored.seed) == (3.0, 4)


def test_state_getter_reports_geometry(rng):
    ls = Lockstep.merge([4, 1], rng)
    keys, values, offset, left_padding = ls.tq.state
    assert offset.tolist() == [4, 1] and left_padding.tolist() == [0, 3]
    assert leaves(keys)[0].shape[2] == ls.tq.size()
    meta = ls.tq.meta_state
    assert all(isinstance(s, str) for s in meta)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("q_heads", [2, 4])
def test_batched_attention_matches_per_request(queries, q_heads, rng):
    """Includes GQA (4 query heads over 2 KV heads) and multi-token queries."""
    ls = Lockstep.merge([7, 2, 0, 4], rng)
    for _ in range(2):
        assert_attention_matches(ls.attend(rng, queries, q_heads=q_heads))
        ls.check()


@pytest.mark.parametrize("dim", [64, 80, 96, 128])
def test_attention_for_each_head_dim(dim, rng):
    ls = Lockstep.merge([3, 5], rng, dim=dim)
    assert_attention_matches(ls.attend(rng, 2, q_heads=4))
    assert_attention_matches(ls.attend(rng, 1))
    ls.check()


# ---------------------------------------------------------------- attention without a mask


def test_decode_attention_without_a_mask_never_attends_padding(rng):
    """Model code may hand the attention mask=None at decode (mlx-vlm's qwen3_5 does,
    for caches with ``bits``): the batch then masks its own padding, as make_mask would."""
    import mlx_vlm.models.base as vlm_base

    ls = Lockstep.merge([5, 2], rng)  # row 1 holds 3 padding slots
    tq, queries = ls.tq, 1
    mask = tq.make_mask(queries)
    q = normal(rng, (2, 4, queries, 64))
    ks, vs = tq.update_and_fetch(normal(rng, (2, 2, queries, 64)), normal(rng, (2, 2, queries, 64)))
    got = vlm_base.scaled_dot_product_attention(q, ks, vs, cache=tq, scale=0.125, mask=None)
    want = vlm_base.scaled_dot_product_attention(q, ks, vs, cache=tq, scale=0.125, mask=mask)
    assert mx.array_equal(got, want)
    # and the guard is what makes them equal: attending every slot differs
    keys, values = tq.dequantize()
    unmasked = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=None)
    assert not mx.allclose(unmasked[1], want[1], atol=1e-3)


def test_a_mask_cut_short_by_model_code_is_completed(rng):
    """mlx-vlm's qwen3_5 cuts the mask to max(offset) + 1 + L columns, one or more short
    once every row is padded; the cache completes it from its own geometry."""
    import mlx_vlm.models.base as vlm_base

    ls = Lockstep.merge([5, 3], rng)
    tq = ls.tq
    tq.prepare(right_padding=[2, 0])  # a ragged commit: every row padded afterwards
    tq.finalize()
    assert min(tq.left_padding.tolist()) == 2
    n = 2
    full = tq.make_mask(n)
    cut = full[..., : int(max(tq.offset.tolist())) + 1 + n]
    assert cut.shape[-1] < full.shape[-1]
    q = normal(rng, (2, 4, n, 64))
    ks, vs = tq.update_and_fetch(normal(rng, (2, 2, n, 64)), normal(rng, (2, 2, n, 64)))
    got = vlm_base.scaled_dot_product_attention(q, ks, vs, cache=tq, scale=0.125, mask=cut)
    want = vlm_base.scaled_dot_product_attention(q, ks, vs, cache=tq, scale=0.125, mask=full)
    assert mx.array_equal(got, want)


def test_a_narrower_mask_that_is_not_the_caches_own_is_left_as_it_is(rng):
    """Only an exact prefix of the cache's own mask is completed: any other narrow mask
    reaches mlx-vlm's attention as given (which refuses it)."""
    import mlx_vlm.models.base as vlm_base

    tq = Lockstep.merge([5, 3], rng).tq
    n = 2
    other = mx.ones((2, 1, n, tq.size()), dtype=mx.bool_)  # narrower, and attends padding
    q = normal(rng, (2, 4, n, 64))
    ks, vs = tq.update_and_fetch(normal(rng, (2, 2, n, 64)), normal(rng, (2, 2, n, 64)))
    with pytest.raises(ValueError):
        mx.eval(vlm_base.scaled_dot_product_attention(q, ks, vs, cache=tq, scale=0.125, mask=other))
