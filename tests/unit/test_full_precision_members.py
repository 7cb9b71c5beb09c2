"""Full-precision caches handed to a batch: merge of KVCache members, extend by BatchKVCache.

The contract: their written tokens are quantized exactly as a single
``TurboQuantKVCache`` of the batch's configuration would quantize them, so
each row holds the packed bits of that request's reference, and nothing the
caller handed over is modified.
"""

from __future__ import annotations

import copy
import pickle

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch import BatchTurboQuantKVCache

from .support import Impl, Lockstep, assert_rejected, leaves, normal, packed_rows_equal

H, D = 2, 64
KV_CLASSES = {"mlx_lm.KVCache": lm_cache.KVCache, "mlx_vlm.KVCache": vlm_cache.KVCache}


def _kv(rng, n: int, dim: int = D):
    return normal(rng, (1, H, n, dim)), normal(rng, (1, H, n, dim))


def _filled(cls, kv):
    cache = cls()
    if kv[0].shape[2]:
        cache.update_and_fetch(*kv)
    return cache


def _reference(kv, bits=4.0, seed=0, **bits_kw) -> TurboQuantKVCache:
    ref = TurboQuantKVCache(bits=bits, seed=seed, **bits_kw)
    if kv[0].shape[2]:
        ref.update_and_fetch(*kv)
    return ref


def _assert_rows_are_references(batch, kvs, refs):
    """Row b holds reference b's packed bits on its real slots, and the geometry says so."""
    end = max(kv[0].shape[2] for kv in kvs)
    assert batch.size() == end
    for b, (kv, ref) in enumerate(zip(kvs, refs)):
        n = kv[0].shape[2]
        assert batch.left_padding[b].item() == end - n
        assert batch.offset[b].item() == n
        if n:
            keys, values = batch.state[:2]
            assert packed_rows_equal(keys, b, end - n, end, ref.state[0])
            assert packed_rows_equal(values, b, end - n, end, ref.state[1])


def _snapshot(cache):
    if cache.keys is None:
        return None
    return [np.array(a) for a in (cache.keys, cache.values)], int(cache.offset)


@pytest.mark.parametrize("kv_class", list(KV_CLASSES), ids=str)
@pytest.mark.parametrize("lengths", [[5, 3], [0, 4], [6, 0, 2]], ids=str)
@pytest.mark.parametrize("bits", [3.5, 3.0], ids=lambda b: f"bits={b}")
def test_merge_quantizes_full_precision_members_like_a_turboquant_cache(
    kv_class, lengths, bits, rng
):
    """A TurboQuant member fixes the configuration (seed 5; 3.5 bits: mlx-vlm's split
    codecs, 3 bits: tqbatch's codec ops); the KVCache members' tokens get exactly the
    codes of a TurboQuantKVCache of it."""
    kvs = [_kv(rng, n) for n in lengths]
    config = {"bits": bits, "seed": 5}
    members = [_reference(kvs[0], **config)] + [_filled(KV_CLASSES[kv_class], kv) for kv in kvs[1:]]
    before = [_snapshot(m) for m in members[1:]]
    batch = Impl.merge(members)
    assert (batch.bits, batch.seed) == (bits, 5)
    _assert_rows_are_references(batch, kvs, [_reference(kv, **config) for kv in kvs])
    for member, old in zip(members[1:], before):  # handed-over caches are not modified
        now = _snapshot(member)
        assert (now is None) == (old is None)
        if now is not None:
            assert now[1] == old[1]
            for a, b in zip(now[0], old[0]):
                np.testing.assert_array_equal(a, b)


def test_merge_reads_only_the_written_tokens_of_a_kvcache(rng):
    """mlx-lm's KVCache allocates in steps of 256 and keeps trimmed tokens in its
    buffer; only ``keys[..., :offset]`` are the request's."""
    kv = _kv(rng, 7)
    member = _filled(lm_cache.KVCache, kv)
    member.trim(3)
    batch = BatchTurboQuantKVCache.configured(bits=4.0).merge([member])
    short = (kv[0][:, :, :4], kv[1][:, :, :4])
    _assert_rows_are_references(batch, [short], [_reference(short)])


def test_merge_of_only_full_precision_members_takes_the_class_configuration(rng):
    """How mlx-vlm's qwen3_5 re-batches rows it ran alone in fresh KVCaches:
    ``cache.__class__.merge(rows)``: the class of a cache knows its configuration."""
    kvs = [_kv(rng, n) for n in (4, 0, 2)]
    running = Impl([0, 0, 0], bits=3.0, seed=9)
    assert isinstance(running, Impl) and type(running).__name__ == Impl.__name__
    batch = type(running).merge([_filled(lm_cache.KVCache, kv) for kv in kvs])
    assert (batch.bits, batch.seed) == (3.0, 9)
    assert type(batch) is type(running)
    _assert_rows_are_references(batch, kvs, [_reference(kv, bits=3.0, seed=9) for kv in kvs])
    # and it goes on as a batch: the next token of every row lands on its reference
    step = normal(rng, (3, H, 1, D)), normal(rng, (3, H, 1, D))
    batch.update_and_fetch(*step)
    for b, kv in enumerate(kvs):
        full = tuple(mx.concatenate([x, s[b : b + 1]], axis=2) for x, s in zip(kv, step))
        ref = _reference(full, bits=3.0, seed=9)
        n = full[0].shape[2]
        assert packed_rows_equal(batch.state[0], b, 5 - n, 5, ref.state[0])


def test_merge_of_only_full_precision_members_needs_a_configuration(rng):
    members = [_filled(lm_cache.KVCache, _kv(rng, 3))]
    with pytest.raises(TypeError, match="configur"):
        BatchTurboQuantKVCache.merge(members)


def test_merge_refuses_a_class_configuration_other_than_the_members(rng):
    member = _reference(_kv(rng, 3), bits=4.0, seed=0)
    with pytest.raises(ValueError, match="mixed"):
        Impl.configured(bits=3.0).merge([member, _filled(lm_cache.KVCache, _kv(rng, 2))])


def test_merge_refuses_full_precision_members_of_another_shape(rng):
    member = _reference(_kv(rng, 3))
    other = _filled(lm_cache.KVCache, _kv(rng, 2, dim=80))
    with pytest.raises(ValueError, match="head_dim"):
        Impl.merge([member, other])
    wide = lm_cache.KVCache()
    wide.update_and_fetch(normal(rng, (2, H, 3, D)), normal(rng, (2, H, 3, D)))
    with pytest.raises(ValueError, match=r"\(1, H, T, D\)"):
        Impl.merge([member, wide])


def test_configured_classes_are_one_per_configuration():
    a = Impl.configured(bits=3.5, seed=1)
    assert a is Impl.configured(bits=3.5, seed=1) is type(Impl([0], bits=3.5, seed=1))
    assert a is not Impl.configured(bits=3.5, seed=2)
    assert issubclass(a, Impl) and a.configured(bits=4.0) is type(Impl([0]))
    with pytest.raises(ValueError, match="key_bits"):
        Impl.configured(bits=4.0, key_bits=2.5)


def test_a_cache_survives_pickle_and_deepcopy(rng):
    ls = Lockstep.merge([4, 2], rng, bits=3.0, seed=4)
    for copied in (pickle.loads(pickle.dumps(ls.tq)), copy.deepcopy(ls.tq)):
        assert type(copied) is type(ls.tq)
        assert copied.meta_state == ls.tq.meta_state
        for a, b in zip(leaves(copied.state[:2]), leaves(ls.tq.state[:2])):
            np.testing.assert_array_equal(np.array(a), np.array(b))


# ---------------------------------------------------------------- extend by BatchKVCache


@pytest.mark.parametrize("dense_class", [lm_cache.BatchKVCache, vlm_cache.BatchKVCache])
def test_extend_quantizes_a_full_precision_batch_row_by_row(dense_class, rng):
    ls = Lockstep.merge([3, 5], rng, bits=4.0, seed=0)
    joiners = [_kv(rng, n) for n in (2, 6)]
    dense = dense_class([4, 0])
    dense.update_and_fetch(
        mx.concatenate([mx.pad(joiners[0][0], [(0, 0), (0, 0), (4, 0), (0, 0)]), joiners[1][0]]),
        mx.concatenate([mx.pad(joiners[0][1], [(0, 0), (0, 0), (4, 0), (0, 0)]), joiners[1][1]]),
    )
    ls.tq.extend(dense)
    assert ls.tq.size() == 6
    assert ls.tq.left_padding.tolist() == [3, 1, 4, 0]
    assert ls.tq.offset.tolist() == [3, 5, 2, 6]
    for b, kv in ((2, joiners[0]), (3, joiners[1])):
        n = kv[0].shape[2]
        ref = _reference(kv)
        assert packed_rows_equal(ls.tq.state[0], b, 6 - n, 6, ref.state[0])
        assert packed_rows_equal(ls.tq.state[1], b, 6 - n, 6, ref.state[1])
    for b, req in enumerate(ls.requests):  # the rows already there are untouched
        n = len(req)
        assert packed_rows_equal(ls.tq.state[0], b, 6 - n, 6, req.reference(4.0, 0).state[0])


def test_extend_refuses_a_full_precision_batch_with_right_padding_pending(rng):
    tq = Lockstep.merge([3, 1], rng).tq
    dense = lm_cache.BatchKVCache([0])
    dense.prepare(right_padding=[1])
    dense.update_and_fetch(normal(rng, (1, H, 2, D)), normal(rng, (1, H, 2, D)))
    assert_rejected(tq, lambda: tq.extend(dense), ValueError, "finalize")
