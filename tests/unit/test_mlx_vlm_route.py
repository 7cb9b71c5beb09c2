"""tqbatch.mlx_vlm: mlx-vlm's batch path builds and joins tqbatch's class, reversibly.

The oracle is mlx-vlm's own single ``TurboQuantKVCache`` per request: each
row of a joined batch, or of a batch restored by mlx-vlm's prefix cache, holds
the packed bits that request's single cache holds, wherever its rows came from
(a full-precision batch, a TurboQuant one, cached K/V, packed snapshots).
"""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_vlm import apc
from mlx_vlm.apc_adapters import clone_cache_entry, merge_cache_entries
from mlx_vlm.generate import ar
from mlx_vlm.kv_quant import from_legacy
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.turboquant import BatchTurboQuantKVCache as VlmBatchTurboQuantKVCache
from mlx_vlm.turboquant import TurboQuantKVCache

import tqbatch.mlx_vlm
from tqbatch import BatchTurboQuantKVCache

from .support import normal, packed_rows_equal

H, D = 2, 64


class _LayersOnly:
    """A model as ``_make_cache`` sees one without ``make_cache``: its layers, counted."""

    def __init__(self, n: int):
        self.layers = [None] * n


@pytest.fixture
def route():
    tqbatch.mlx_vlm.disable()
    yield tqbatch.mlx_vlm
    tqbatch.mlx_vlm.disable()


def _left_padded(rows, end):
    return mx.concatenate(
        [mx.pad(r, [(0, 0), (0, 0), (end - r.shape[2], 0), (0, 0)]) for r in rows]
    )


def _batch(cls, lengths, rng, **config):
    """A batch of ``cls`` holding one random request per length, left-padded; and the requests."""
    end = max(lengths)
    requests = [(normal(rng, (1, H, n, D)), normal(rng, (1, H, n, D))) for n in lengths]
    cache = cls([end - n for n in lengths], **config)
    cache.update_and_fetch(
        _left_padded([k for k, _ in requests], end), _left_padded([v for _, v in requests], end)
    )
    return cache, requests


def _assert_rows_are_singles(batch, requests, rows=None):
    end = batch.size()
    for b, (k, v) in zip(rows if rows is not None else range(len(requests)), requests):
        n = k.shape[2]
        single = TurboQuantKVCache(bits=4.0, seed=0)
        single.update_and_fetch(k, v)
        assert batch.offset[b].item() == n
        assert batch.left_padding[b].item() == end - n
        assert packed_rows_equal(batch.state[0], b, end - n, end, single.state[0])
        assert packed_rows_equal(batch.state[1], b, end - n, end, single.state[1])


def test_importing_the_module_patches_nothing():
    code = (
        "import tqbatch.mlx_vlm as m; from mlx_vlm.generate import ar; "
        "from mlx_vlm.turboquant import BatchTurboQuantKVCache as V; "
        "from mlx_vlm import apc; "
        "assert ar.BatchTurboQuantKVCache is V and ar._extend_cache.__module__ == ar.__name__; "
        "assert apc._fill_batch_layer_cache.__module__ == apc.__name__; "
        "assert apc._empty_quant_batch_cache.__module__ == apc.__name__; "
        "assert not m.is_enabled()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_enable_makes_the_batch_path_build_tqbatch_and_disable_gives_it_back(route):
    make = lambda: ar._make_cache(  # noqa: E731
        _LayersOnly(2), [3, 0], kv_bits=4, kv_quant_scheme="turboquant", quantized_kv_start=0
    )
    assert {type(c) for c in make()} == {VlmBatchTurboQuantKVCache}
    route.enable()
    route.enable()  # idempotent
    built = make()
    assert all(isinstance(c, BatchTurboQuantKVCache) for c in built)  # a configured subclass
    assert [c.left_padding.tolist() for c in built] == [[3, 0], [3, 0]]
    assert all((c.bits, c.seed) == (4.0, 0) for c in built)
    route.disable()
    assert {type(c) for c in make()} == {VlmBatchTurboQuantKVCache}
    assert ar._extend_cache is not tqbatch.mlx_vlm.join_caches


def test_deferred_groups_stay_full_precision_as_mlx_vlm_decides(route):
    route.enable()
    built = ar._make_cache(
        _LayersOnly(2),
        [0],
        kv_bits=4,
        kv_quant_scheme="turboquant",
        quantized_kv_start=100,
        prefill_length=10,
    )
    assert {type(c) for c in built} == {vlm_cache.BatchKVCache}


def test_enabled_restores_what_it_found(route):
    with route.enabled():
        assert route.is_enabled()
        with route.enabled():
            pass
        assert route.is_enabled()
    assert not route.is_enabled()


@pytest.mark.parametrize("running_first", ["full-precision", "turboquant"])
def test_a_full_precision_batch_and_a_turboquant_one_join_through_tqbatch(
    route, rng, running_first
):
    dense, dense_requests = _batch(vlm_cache.BatchKVCache, [5, 2], rng)
    tq, tq_requests = _batch(BatchTurboQuantKVCache, [3], rng, bits=4.0, seed=0)
    pairs = [(dense, dense_requests), (tq, tq_requests)]
    if running_first == "turboquant":
        pairs.reverse()
    (a, a_requests), (b, b_requests) = pairs
    route.enable()
    (joined,) = ar._extend_cache([a], [b])
    assert isinstance(joined, BatchTurboQuantKVCache)
    assert joined.batch_size == 3
    _assert_rows_are_singles(joined, a_requests + b_requests)


def test_mlx_vlm_own_join_of_the_same_batches_raises(route, rng):
    """What the route changes: mlx-vlm's class cannot join a full-precision batch either way."""
    for running in (True, False):
        dense, _ = _batch(vlm_cache.BatchKVCache, [5, 2], rng)
        tq, _ = _batch(VlmBatchTurboQuantKVCache, [3], rng, bits=4.0)
        a, b = (dense, tq) if running else (tq, dense)
        with pytest.raises((AttributeError, TypeError)):
            ar._extend_cache([a], [b])


def _turboquant_config(bits=4):
    return from_legacy(bits, "turboquant", 64).to_config()


def _cached_prefix(rng, n):
    """A request's cached prefix as mlx-vlm's block store keeps it: dense K/V of one layer."""
    cache = vlm_cache.KVCache()
    cache.update_and_fetch(normal(rng, (1, H, n, D)), normal(rng, (1, H, n, D)))
    return cache


def test_prefix_cache_restores_tqbatch_batches_and_disable_gives_mlx_vlm_its_own(route, rng):
    """The block strategy: every quantized layer of a mixed warm / cold batch is tqbatch's."""
    layers, lengths = 3, [7, 0, 4]  # the middle row has no cached prefix
    warm = {n: [_cached_prefix(rng, n) for _ in range(layers)] for n in lengths if n}
    picks = [{"warm_cache": warm[n], "prefix_len": n} if n else None for n in lengths]
    config = _turboquant_config()

    def restore():
        caches, longest = apc.make_warm_batch_kv_cache_multi(
            picks, num_layers=layers, kv_quant_config=config
        )
        assert longest == max(lengths)
        return caches

    assert [type(c) for c in restore()[:2]] == [VlmBatchTurboQuantKVCache] * 2
    route.enable()
    restored = restore()
    # mlx-vlm keeps a deep stack's last layer full precision: so does the route.
    assert type(restored[2]) is vlm_cache.BatchKVCache
    for layer, batch in enumerate(restored[:2]):
        assert isinstance(batch, BatchTurboQuantKVCache)
        assert batch.offset.tolist() == lengths
        requests = [
            (warm[n][layer].keys[..., :n, :], warm[n][layer].values[..., :n, :]) if n else None
            for n in lengths
        ]
        _assert_rows_are_singles(batch, [r for r in requests if r is not None], rows=[0, 2])
    route.disable()
    assert [type(c) for c in restore()[:2]] == [VlmBatchTurboQuantKVCache] * 2


def test_quantizing_dequantized_k_v_again_changes_them(rng):
    """Why a prefix restored by mlx-vlm's block prefix cache (dequantized K/V, quantized
    again on restore) is not the computed prefix, whichever class restores it."""
    keys, values = normal(rng, (1, H, 16, D)), normal(rng, (1, H, 16, D))
    computed = TurboQuantKVCache(bits=4.0, seed=0)
    computed.update_and_fetch(keys, values)
    restored = TurboQuantKVCache(bits=4.0, seed=0)
    restored.update_and_fetch(*computed.dequantize())
    assert not mx.array_equal(restored.dequantize()[0], computed.dequantize()[0])


def test_prefix_cache_builds_mlx_vlm_classes_for_other_policies(route, rng):
    route.enable()
    uniform = from_legacy(4, None, 64).to_config()
    (batch,), _ = apc.make_warm_batch_kv_cache_multi(
        [{"warm_cache": [_cached_prefix(rng, 5)], "prefix_len": 5}],
        num_layers=1,
        kv_quant_config=uniform,
    )
    assert type(batch) is vlm_cache.BatchQuantizedKVCache
    assert type(apc._empty_quant_batch_cache([0, 0], uniform)) is vlm_cache.BatchQuantizedKVCache


def test_an_empty_prefix_batch_is_tqbatch_and_joins_a_running_one(route, rng):
    route.enable()
    empty = apc._empty_quant_batch_cache([0, 0], _turboquant_config())
    assert isinstance(empty, BatchTurboQuantKVCache) and empty.left_padding.tolist() == [0, 0]
    running, requests = _batch(BatchTurboQuantKVCache, [4, 2], rng, bits=4.0, seed=0)
    restored = apc._fill_batch_layer_cache(
        _left_padded([k for k, _ in requests], 4),
        _left_padded([v for _, v in requests], 4),
        [0, 2],
        [4, 2],
        quantize=True,
        kv_quant_config=_turboquant_config(),
    )
    (joined,) = ar._extend_cache([running], [restored])
    _assert_rows_are_singles(joined, requests + requests)


def test_checkpoint_snapshots_of_tqbatch_rows_merge_into_tqbatch_packed_as_they_were(route, rng):
    """The checkpoint strategy: rows extracted and cloned as mlx-vlm's prefix cache does."""
    route.enable()
    batch, requests = _batch(BatchTurboQuantKVCache, [6, 3], rng, bits=4.0, seed=0)
    rows = [
        clone_cache_entry(batch.extract(i), min_capacity_tokens=0, eval_targets=[]) for i in (0, 1)
    ]
    merged = merge_cache_entries(rows + [vlm_cache.KVCache()], [6, 3, 0])
    assert isinstance(merged, BatchTurboQuantKVCache)
    assert merged.offset.tolist() == [6, 3, 0]
    _assert_rows_are_singles(merged, requests, rows=[0, 1])


@pytest.mark.parametrize(
    "prefix_lens, other_bits",
    [([6, 2], 4.0), ([6, 3], 8.0)],
    ids=["a row not its prefix length", "another configuration"],
)
def test_checkpoint_merge_declines_rows_it_cannot_batch(rng, prefix_lens, other_bits):
    a, _ = _batch(BatchTurboQuantKVCache, [6], rng, bits=4.0, seed=0)
    b, _ = _batch(BatchTurboQuantKVCache, [3], rng, bits=other_bits, seed=0)
    rows = [a.extract(0), b.extract(0)]
    assert rows[0].prefix_cache_merge(rows, prefix_lens) is None
