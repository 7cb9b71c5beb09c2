"""Bad input: a typed error whose message says what was wrong, and the cache
exactly as it was (``assert_rejected`` compares every observable before and
after), still in lockstep with BatchKVCache and the references afterwards."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache
from mlx_vlm.turboquant import BatchTurboQuantKVCache as VlmBatchTurboQuantKVCache
from mlx_vlm.turboquant import TurboQuantKVCache, TurboQuantMSEState

from .support import Impl, Lockstep, assert_rejected, normal, observe, then_still_in_lockstep


@pytest.fixture(params=["filled", "empty"])
def any_batch(request, rng) -> Lockstep:
    if request.param == "empty":
        return Lockstep.new([0, 2, 1])
    ls = Lockstep.merge([5, 2, 3], rng)
    ls.update(rng, 1)
    return ls


# ---------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    "left_padding,error,pattern",
    [
        ([0, -1], ValueError, r"negative"),
        ([], ValueError, r"left_padding"),
        ([0, 1.5], TypeError, r"1\.5"),
        (3, TypeError, r"left_padding"),
    ],
    ids=str,
)
def test_constructor_rejects_bad_left_padding(left_padding, error, pattern):
    with pytest.raises(error, match=pattern):
        Impl(left_padding)


# ---------------------------------------------------------------- filter


@pytest.mark.parametrize(
    "indices,error,pattern",
    [
        ([0, 3], IndexError, r"3.*range|range.*3"),
        ([7], IndexError, r"7.*range|range.*7"),
        ([-1], IndexError, r"-1.*range|range.*-1"),
        ([1, 1], ValueError, r"duplicate"),
        ([2, 0, 2], ValueError, r"duplicate"),
        ([], ValueError, r"index|indices"),
    ],
    ids=str,
)
def test_filter_rejects_bad_indices(any_batch, indices, error, pattern, rng):
    tq = any_batch.tq
    assert_rejected(tq, lambda: tq.filter(indices), error, pattern)
    if not tq.empty():
        then_still_in_lockstep(any_batch, rng)


# ---------------------------------------------------------------- extract


@pytest.mark.parametrize("index", [3, 10, -4])
def test_extract_rejects_out_of_range_rows(batch, index, rng):
    tq = batch.tq
    assert_rejected(tq, lambda: tq.extract(index), IndexError, str(index), r"range")
    then_still_in_lockstep(batch, rng)


def test_extract_rejects_a_non_integer_row(batch):
    assert_rejected(batch.tq, lambda: batch.tq.extract(1.0), TypeError, r"int")


# ---------------------------------------------------------------- prepare


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        (dict(left_padding=[0, -2, 0]), ValueError, r"left_padding.*negative|negative.*left"),
        (dict(right_padding=[0, 0, -1]), ValueError, r"right_padding.*negative|negative.*right"),
        (dict(left_padding=[1, 1]), ValueError, r"left_padding.*2.*3|left_padding.*3.*2"),
        (dict(right_padding=[1, 1, 1, 1]), ValueError, r"right_padding.*4.*3|right_padding.*3.*4"),
        (dict(lengths=[1, 2]), ValueError, r"lengths"),
        # a valid left padding must not be applied when the right padding is bad
        (dict(left_padding=[1, 0, 0], right_padding=[-1, 0, 0]), ValueError, r"right_padding"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_prepare_rejects_bad_padding(kwargs, error, pattern, rng):
    ls = Lockstep.new([0, 1, 0])
    assert_rejected(ls.tq, lambda: ls.tq.prepare(**kwargs), error, pattern)
    ls.check_geometry()
    ls.update(rng, 3)
    ls.check()


def test_prepare_left_padding_on_a_non_empty_cache(batch, rng):
    tq = batch.tq
    assert_rejected(tq, lambda: tq.prepare(left_padding=[1, 1, 1]), ValueError, r"empty")
    then_still_in_lockstep(batch, rng)


# ---------------------------------------------------------------- merge


def _foreign_caches():
    """Caches a batch must refuse: batch caches, and single caches that are not
    TurboQuant or plain full-precision KVCaches (their tokens are not the request's
    exact K/V: affine-quantized, or a rotating window)."""
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 2, 2, 64)), mx.zeros((1, 2, 2, 64)))
    quantized = QuantizedKVCache(group_size=64, bits=4)
    quantized.update_and_fetch(mx.zeros((1, 2, 2, 64)), mx.zeros((1, 2, 2, 64)))
    return {
        "mlx_lm.KVCache": kv,
        "mlx_lm.QuantizedKVCache": quantized,
        "mlx_lm.RotatingKVCache": RotatingKVCache(max_size=8),
        "mlx_lm.BatchKVCache": BatchKVCache([0]),
        "mlx_vlm.BatchTurboQuantKVCache": VlmBatchTurboQuantKVCache([0], bits=4.0),
        "tqbatch batch": Impl([0]),
        "not a cache": "keys",
    }


# KVCache joins a merge and BatchKVCache an extend (quantized on the way in).
MERGE_REFUSES = [n for n in _foreign_caches() if n != "mlx_lm.KVCache"]
EXTEND_REFUSES = [n for n in _foreign_caches() if n not in ("mlx_lm.BatchKVCache", "tqbatch batch")]


@pytest.mark.parametrize("name", MERGE_REFUSES)
def test_merge_rejects_foreign_members(name, rng):
    good = TurboQuantKVCache(bits=4.0)
    good.update_and_fetch(normal(rng, (1, 2, 3, 64)), normal(rng, (1, 2, 3, 64)))
    foreign = _foreign_caches()[name]
    with pytest.raises(TypeError) as info:
        Impl.merge([good, foreign])
    assert type(foreign).__name__ in str(info.value)


def test_merge_rejects_no_members():
    with pytest.raises(ValueError, match="at least one"):
        Impl.merge([])


@pytest.mark.parametrize(
    "shapes,pattern",
    [
        ([(2, 64), (1, 64)], r"head"),  # KV heads differ
        ([(2, 64), (2, 80)], r"head_dim|dim"),
    ],
    ids=["heads", "head_dim"],
)
def test_merge_rejects_members_of_different_shapes(shapes, pattern, rng):
    members = []
    for heads, dim in shapes:
        c = TurboQuantKVCache(bits=4.0)
        c.update_and_fetch(normal(rng, (1, heads, 3, dim)), normal(rng, (1, heads, 3, dim)))
        members.append(c)
    states = [[np.array(a) for a in (c.state[0].norms, c.state[0].indices)] for c in members]
    with pytest.raises(ValueError, match=pattern):
        Impl.merge(members)
    for c, before in zip(members, states):  # members untouched
        np.testing.assert_array_equal(np.array(c.state[0].norms), before[0])
        np.testing.assert_array_equal(np.array(c.state[0].indices), before[1])


# ---------------------------------------------------------------- extend


@pytest.mark.parametrize("name", EXTEND_REFUSES)
def test_extend_rejects_foreign_caches(any_batch, name, rng):
    foreign = _foreign_caches()[name]
    tq = any_batch.tq
    assert_rejected(tq, lambda: tq.extend(foreign), TypeError, type(foreign).__name__)
    if not tq.empty():
        then_still_in_lockstep(any_batch, rng)


def test_extend_rejects_a_single_request_cache(batch, rng):
    single = TurboQuantKVCache(bits=4.0)
    single.update_and_fetch(normal(rng, (1, 2, 2, 64)), normal(rng, (1, 2, 2, 64)))
    assert_rejected(batch.tq, lambda: batch.tq.extend(single), TypeError, "TurboQuantKVCache")
    then_still_in_lockstep(batch, rng)


@pytest.mark.parametrize(
    "heads,dim,pattern", [(1, 64, r"head"), (2, 80, r"head_dim|dim")], ids=["heads", "head_dim"]
)
def test_extend_rejects_other_shapes(batch, heads, dim, pattern, rng):
    other = Lockstep.merge([3], rng, heads=heads, dim=dim)
    other_before = observe(other.tq)
    assert_rejected(batch.tq, lambda: batch.tq.extend(other.tq), ValueError, pattern)
    assert observe(other.tq) == other_before
    then_still_in_lockstep(batch, rng)


def test_extend_rejects_mixed_key_bits(batch, rng):
    other = Lockstep.merge([3], rng, key_bits=3)
    assert_rejected(batch.tq, lambda: batch.tq.extend(other.tq), ValueError, r"3\.0", r"4\.0")
    then_still_in_lockstep(batch, rng)


# ---------------------------------------------------------------- update_and_fetch


@pytest.mark.parametrize(
    "key_shape,value_shape,pattern",
    [
        ((2, 2, 1, 64), (2, 2, 1, 64), r"2 rows|rows|batch"),  # B: 2 rows for a batch of 3
        ((4, 2, 1, 64), (4, 2, 1, 64), r"4 rows|rows|batch"),
        ((3, 1, 1, 64), (3, 1, 1, 64), r"heads"),
        ((3, 2, 1, 80), (3, 2, 1, 80), r"head_dim|dim"),
        ((3, 2, 1, 64), (3, 2, 1, 80), r"head_dim|dim"),
        ((3, 2, 2, 64), (3, 2, 1, 64), r"disagree|values"),
        ((3, 2, 0, 64), (3, 2, 0, 64), r"T >= 1|token"),
        ((3, 2, 64), (3, 2, 64), r"\(B, H, T, D\)|4"),
    ],
    ids=str,
)
def test_update_rejects_mismatched_keys_and_values(batch, key_shape, value_shape, pattern, rng):
    tq = batch.tq
    keys, values = normal(rng, key_shape), normal(rng, value_shape)
    assert_rejected(tq, lambda: tq.update_and_fetch(keys, values), ValueError, pattern)
    then_still_in_lockstep(batch, rng)


def test_update_rejects_wrong_batch_on_an_empty_cache(rng):
    ls = Lockstep.new([0, 0])
    keys = normal(rng, (3, 2, 4, 64))
    assert_rejected(ls.tq, lambda: ls.tq.update_and_fetch(keys, keys), ValueError, r"rows")
    ls.update(rng, 4)
    ls.check()


# ---------------------------------------------------------------- trim


@pytest.mark.parametrize("n,error", [(-1, ValueError), (1.5, ValueError), (True, ValueError)])
def test_trim_rejects_bad_counts(batch, n, error, rng):
    assert_rejected(batch.tq, lambda: batch.tq.trim(n), error, str(n))
    then_still_in_lockstep(batch, rng)


def test_trim_while_right_padding_is_pending(rng):
    ls = Lockstep.new([0, 0])
    ls.prepare(right_padding=[2, 0])
    ls.update(rng, 5)
    assert_rejected(ls.tq, lambda: ls.tq.trim(1), ValueError, r"right padding|finalize")
    ls.finalize()
    ls.check()


# ---------------------------------------------------------------- state / meta_state


def _malformed_states(tq):
    keys, values, offset, left_padding = tq.state
    short = TurboQuantMSEState(values.norms[:, :, :-1], values.indices[:, :, :-1])
    return {
        "three fields": ((keys, values, offset), r"state"),
        "None": (None, r"state"),
        "offset drift": ((keys, values, offset + 1, left_padding), r"offset"),
        "negative padding": ((keys, values, offset, left_padding - 9), r"negative"),
        "rows": ((keys, values, offset[:2], left_padding[:2]), r"rows"),
        "keys without values": ((keys, None, offset, left_padding), r"values"),
        "not packed": ((mx.zeros((3, 2, 6, 64)), values, offset, left_padding), r"packed"),
        "padding length": ((keys, values, offset, left_padding[:2]), r"left_padding"),
        "values shorter than keys": ((keys, short, offset, left_padding), r"values|length|slots"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "three fields",
        "None",
        "offset drift",
        "negative padding",
        "rows",
        "keys without values",
        "not packed",
        "padding length",
        # regression: the setter once accepted 6 key slots with 5 value slots
        "values shorter than keys",
    ],
)
def test_state_setter_rejects_malformed_state(batch, case, rng):
    tq = batch.tq
    value, pattern = _malformed_states(tq)[case]

    def assign():
        tq.state = value

    assert_rejected(tq, assign, (ValueError, TypeError), pattern)
    then_still_in_lockstep(batch, rng)


def _malformed_meta(meta):
    end, bits, seed, key_bits, value_bits, key_dim, value_dim, pending = meta
    return {
        "seven fields": (meta[:7], r"meta_state|8"),
        "end": ((str(int(end) + 1),) + meta[1:], r"end"),
        "head_dim": (meta[:5] + ("80", "80", pending), r"head_dim|width"),
        "bits": (meta[:1] + ("2.3",) + meta[2:], r"2\.3|bit"),
        "not a number": (meta[:2] + ("seed",) + meta[3:], r"seed"),
        "pending rows": (meta[:7] + ("1,2",), r"right padding|rows"),
        "negative pending": (meta[:7] + ("0,-1,0",), r"negative"),
        "fractional key bits": (meta[:3] + ("2.5",) + meta[4:], r"key_bits|2\.5"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "seven fields",
        "end",
        "head_dim",
        "bits",
        "not a number",
        "pending rows",
        "negative pending",
        "fractional key bits",
    ],
)
def test_meta_state_setter_rejects_malformed_meta_state(batch, case, rng):
    tq = batch.tq
    value, pattern = _malformed_meta(tuple(tq.meta_state))[case]

    def assign():
        tq.meta_state = value

    assert_rejected(tq, assign, ValueError, pattern)
    then_still_in_lockstep(batch, rng)


def test_meta_state_rejects_fractional_key_bits_on_an_empty_cache():
    """Regression: the setter once built a data-dependent split codec from zeros."""
    tq = Impl([0, 0])

    def assign():
        tq.meta_state = ("0", "4.0", "0", "2.5", "4.0", "64", "64", "")

    assert_rejected(tq, assign, ValueError, r"key_bits|2\.5")


def test_meta_state_setter_accepts_its_own_meta_state_after_decode(batch, rng):
    """Regression: the setter once compared the written end with the allocated capacity."""
    before = observe(batch.tq)
    batch.tq.meta_state = batch.tq.meta_state
    assert observe(batch.tq) == before


def test_from_state_rejects_a_mismatched_pair(batch, rng):
    other = Lockstep.merge([4, 4], rng)
    with pytest.raises(ValueError, match="end|rows|right padding"):
        Impl.from_state(batch.tq.state, other.tq.meta_state[:7] + ("1,1",))
