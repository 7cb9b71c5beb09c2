"""Meta-tests of the model matrix's capture helpers: the ledger and the attention log."""

from __future__ import annotations

import mlx.core as mx
import mlx_vlm.models.base as vlm_base
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch import BatchableTurboQuantKVCache, BatchTurboQuantKVCache
from tqbatch.workbench.kv_ledger import AttentionLog, KVLedger

from .support import normal


def test_ledger_records_each_write_by_the_object_that_received_it(rng):
    a, b = KVCache(), TurboQuantKVCache(bits=4.0)
    k1, v1 = normal(rng, (1, 2, 3, 64)), normal(rng, (1, 2, 3, 64))
    k2, v2 = normal(rng, (1, 2, 1, 64)), normal(rng, (1, 2, 1, 64))
    original = vars(KVCache)["update_and_fetch"]
    with KVLedger((KVCache, TurboQuantKVCache)) as ledger:
        a.update_and_fetch(k1, v1)
        b.update_and_fetch(k2, v2)
        a.update_and_fetch(k2, v2)
    assert [w[0] is k for w, k in zip(ledger.writes_to(a), (k1, k2))] == [True, True]
    assert len(ledger.writes_to(b)) == 1 and ledger.writes_to(b)[0][1] is v2
    # the classes are restored: later writes go unrecorded
    a.update_and_fetch(k2, v2)
    assert len(ledger.writes_to(a)) == 2
    assert vars(KVCache)["update_and_fetch"] is original


def test_ledger_records_a_nested_write_once(rng):
    """A batch cache that quantizes through its parent's update_and_fetch is one write."""
    batch = BatchTurboQuantKVCache([0, 1])
    k, v = normal(rng, (2, 2, 2, 64)), normal(rng, (2, 2, 2, 64))
    with KVLedger((BatchTurboQuantKVCache, TurboQuantKVCache)) as ledger:
        batch.update_and_fetch(k, v)
    assert len(ledger.writes_to(batch)) == 1


def test_ledger_records_a_write_through_a_parents_method_once(rng):
    """BatchableTurboQuantKVCache.update_and_fetch calls mlx-vlm's: both wrapped, one write."""
    single = BatchableTurboQuantKVCache(bits=4)
    k, v = normal(rng, (1, 2, 2, 64)), normal(rng, (1, 2, 2, 64))
    with KVLedger((BatchableTurboQuantKVCache, TurboQuantKVCache)) as ledger:
        single.update_and_fetch(k, v)
        single.update_and_fetch(k, v)
    assert len(ledger.writes_to(single)) == 2


def test_ledger_records_merges_and_their_members(rng):
    singles = [KVCache(), KVCache()]
    for n, single in zip((3, 1), singles):
        single.update_and_fetch(normal(rng, (1, 2, n, 64)), normal(rng, (1, 2, n, 64)))
    with KVLedger((KVCache,), (BatchKVCache,)) as ledger:
        merged = BatchKVCache.merge(singles)
    record = ledger.merge_into(merged)
    assert record is not None and list(record.members) == singles
    assert isinstance(vars(BatchKVCache)["merge"], classmethod)  # restored as it was
    assert ledger.merge_into(BatchKVCache.merge(singles)) is None  # outside the block


def test_ledger_restores_the_classes_when_the_block_raises(rng):
    original = vars(KVCache)["update_and_fetch"]
    with pytest.raises(RuntimeError), KVLedger((KVCache,)):
        raise RuntimeError
    assert vars(KVCache)["update_and_fetch"] is original


def test_attention_log_records_calls_and_restores_the_module(rng):
    class Module:
        scaled_dot_product_attention = staticmethod(vlm_base.scaled_dot_product_attention)

    cache = KVCache()
    q = normal(rng, (1, 2, 1, 64))
    k, v = normal(rng, (1, 2, 4, 64)), normal(rng, (1, 2, 4, 64))
    original = Module.scaled_dot_product_attention
    with AttentionLog([Module]) as log:
        out = Module.scaled_dot_product_attention(q, k, v, cache=cache, scale=0.125, mask=None)
    assert Module.scaled_dot_product_attention is original
    (call,) = log.calls_on(cache)
    assert call.queries is q and call.output is out and call.scale == 0.125 and call.sinks is None
    assert mx.array_equal(
        out, vlm_base.scaled_dot_product_attention(q, k, v, cache=None, scale=0.125, mask=None)
    )
