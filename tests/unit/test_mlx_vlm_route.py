"""tqbatch.mlx_vlm: mlx-vlm's batch path builds and joins tqbatch's class, reversibly.

The join's oracle is mlx-vlm's own single ``TurboQuantKVCache`` per request:
each row of a joined batch holds the packed bits that request's single cache
holds, wherever its rows came from (a full-precision batch or a TurboQuant one).
"""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_vlm.generate import ar
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


def _assert_rows_are_singles(batch, requests):
    end = batch.size()
    for b, (k, v) in enumerate(requests):
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
        "assert ar.BatchTurboQuantKVCache is V and ar._extend_cache.__module__ == ar.__name__; "
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
