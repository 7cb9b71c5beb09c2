"""Run mlx-vlm's batched generation, and so its server, on tqbatch's batch cache.

mlx-vlm builds its own ``BatchTurboQuantKVCache`` wherever a batch runs with
TurboQuant KV quantization (``--kv-bits B --kv-quant-scheme turboquant``).
``enable()`` makes the continuous-batching path (``mlx_vlm.generate.ar._make_cache``,
through a global name of that module) build :class:`tqbatch.BatchTurboQuantKVCache`
instead, with the same ``left_padding``, ``bits``, ``key_bits`` and ``value_bits``.

Automatic prefix caching (``APC_ENABLED=1`` in mlx-vlm's server) restores
cached prefixes into batches of the same class. Its block strategy (models
whose layers are plain ``KVCache``s) stores dequantized K/V and re-quantizes
them on restore through ``mlx_vlm.apc._fill_batch_layer_cache`` and
``_empty_quant_batch_cache``; ``enable()`` replaces both so that a TurboQuant
policy gets tqbatch's class, filled as a left-padded prefill. Its checkpoint
strategy (hybrid models) merges packed single-row snapshots with the first
row's ``prefix_cache_merge``: rows extracted from tqbatch's batches are
``BatchableTurboQuantKVCache``s, whose ``prefix_cache_merge`` builds tqbatch's
class. Re-quantizing dequantized K/V does not give back the codes they came
from, so a prefix restored by the block strategy is not bit-equal to the
prefix computed fresh, whichever class restores it.

It also joins a running full-precision batch with a TurboQuant one through
tqbatch's class. mlx-vlm defers quantization per prefill group
(``--quantized-kv-start N``: a group whose prompts are all shorter than N
runs on a full-precision ``BatchKVCache``), and its join
(``mlx_vlm.generate.ar._extend_cache``) calls the running batch's
``extend`` with the new one: mlx-vlm's classes raise there either way round.
tqbatch's ``extend`` takes a full-precision batch (quantizing its rows as a
single ``TurboQuantKVCache`` would); where the running batch is the
full-precision one, its rows are quantized into tqbatch's class first, so
the batch's row order is the one mlx-vlm asked for.

mlx-vlm's attention already serves tqbatch's class: it is a
``TurboQuantKVCache`` subclass, which ``mlx_vlm.models.base`` hands to the
cache's own ``decode_attention`` / ``prefill_attention``. Nothing else in
mlx-vlm is changed.

Importing this module patches nothing; ``enable()`` and ``disable()`` are
idempotent, ``enabled()`` restores what it found::

    import tqbatch.mlx_vlm
    tqbatch.mlx_vlm.enable()  # then start mlx-vlm's server or BatchGenerator

``tqbatch serve mlx-vlm -- ARGS`` does that and runs ``mlx_vlm.server`` with ARGS.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from mlx_vlm import apc as _vlm_apc
from mlx_vlm.generate import ar as _vlm_ar

from tqbatch.cache import FULL_PRECISION_BATCHES, BatchTurboQuantKVCache

__all__ = [
    "disable",
    "empty_prefix_batch",
    "enable",
    "enabled",
    "fill_prefix_batch",
    "is_enabled",
    "join_caches",
]

# mlx-vlm's class, join and prefix-cache builders, taken before anything here can have
# replaced them.
_VLM_CLASS = _vlm_ar.BatchTurboQuantKVCache
_VLM_EXTEND = _vlm_ar._extend_cache
_VLM_FILL = _vlm_apc._fill_batch_layer_cache
_VLM_EMPTY = _vlm_apc._empty_quant_batch_cache
_LOCK = threading.Lock()


def join_caches(cache_a: list, cache_b: list) -> list:
    """mlx-vlm's ``_extend_cache``, with full-precision rows joining tqbatch's batches.

    Per layer: where ``cache_b``'s entry is a tqbatch batch and ``cache_a``'s a
    full-precision batch cache, ``cache_a``'s rows are first quantized into a
    new tqbatch batch of ``cache_b``'s configuration; the other way round,
    tqbatch's ``extend`` takes the full-precision batch itself. Every other
    pair is joined by mlx-vlm's own code, unchanged.
    """
    if cache_a and cache_b:
        cache_a = [
            b._quantized_batch(a)
            if isinstance(b, BatchTurboQuantKVCache) and type(a) in FULL_PRECISION_BATCHES
            else a
            for a, b in zip(cache_a, cache_b)
        ]
    return _VLM_EXTEND(cache_a, cache_b)


def _turboquant_policy(kv_quant_config):
    """The policy of ``kv_quant_config`` where it quantizes every side with TurboQuant."""
    policy = _vlm_apc.kv_quant_from_config(kv_quant_config)
    if policy is None or not policy.is_homogeneous or not policy.is_turboquant:
        return None
    return policy


def _prefix_batch(left_padding, policy):
    """An empty batch of the class mlx-vlm's batch path builds now, for ``policy``."""
    return _vlm_ar.BatchTurboQuantKVCache(
        [int(n) for n in left_padding],
        bits=policy.bits,
        key_bits=policy.key.bits,
        value_bits=policy.value.bits,
    )


def fill_prefix_batch(merged_k, merged_v, left_padding, offset, *, quantize, kv_quant_config):
    """``mlx_vlm.apc._fill_batch_layer_cache``, building tqbatch's class for TurboQuant.

    ``merged_k``/``merged_v`` hold each row's cached prefix right-aligned
    behind ``left_padding`` zeros, as a left-padded prefill does; ``offset``
    is then implied (``size - left_padding``). Every other policy, and a
    layer left full precision, is mlx-vlm's own code.
    """
    policy = _turboquant_policy(kv_quant_config) if quantize and kv_quant_config else None
    if policy is None:
        return _VLM_FILL(
            merged_k,
            merged_v,
            left_padding,
            offset,
            quantize=quantize,
            kv_quant_config=kv_quant_config,
        )
    cache = _prefix_batch(left_padding, policy)
    cache.update_and_fetch(merged_k, merged_v)
    return cache


def empty_prefix_batch(left_padding, kv_quant_config):
    """``mlx_vlm.apc._empty_quant_batch_cache``, building tqbatch's class for TurboQuant."""
    policy = _turboquant_policy(kv_quant_config)
    if policy is None:
        return _VLM_EMPTY(left_padding, kv_quant_config)
    return _prefix_batch(left_padding, policy)


def enable(batch_class: type = BatchTurboQuantKVCache) -> None:
    """Make mlx-vlm build and join tqbatch's batch cache (see the module docstring).

    ``batch_class``: a subclass of tqbatch's class to build instead (a test
    double, a cache under test); it is called as mlx-vlm calls its own,
    ``batch_class(left_padding, bits=..., key_bits=..., value_bits=...)``.
    """
    if not (isinstance(batch_class, type) and issubclass(batch_class, BatchTurboQuantKVCache)):
        raise TypeError(
            f"batch_class must be a subclass of tqbatch.BatchTurboQuantKVCache, got {batch_class!r}"
        )
    with _LOCK:
        _install(batch_class, join_caches, fill_prefix_batch, empty_prefix_batch)


def disable() -> None:
    """Give mlx-vlm its own class, join and prefix-cache builders back. Idempotent."""
    with _LOCK:
        _install(_VLM_CLASS, _VLM_EXTEND, _VLM_FILL, _VLM_EMPTY)


def _installed() -> tuple:
    return (
        _vlm_ar.BatchTurboQuantKVCache,
        _vlm_ar._extend_cache,
        _vlm_apc._fill_batch_layer_cache,
        _vlm_apc._empty_quant_batch_cache,
    )


def _install(batch_class, join, fill, empty) -> None:
    _vlm_ar.BatchTurboQuantKVCache = batch_class
    _vlm_ar._extend_cache = join
    _vlm_apc._fill_batch_layer_cache = fill
    _vlm_apc._empty_quant_batch_cache = empty


def is_enabled() -> bool:
    """Whether mlx-vlm's batch path currently builds tqbatch's class (or a subclass)."""
    return _vlm_ar.BatchTurboQuantKVCache is not _VLM_CLASS


@contextmanager
def enabled(batch_class: type = BatchTurboQuantKVCache) -> Iterator[None]:
    """``enable(batch_class)`` for the block; on exit, the class it found is built again."""
    with _LOCK:
        found = _installed()
    enable(batch_class)
    try:
        yield
    finally:
        with _LOCK:
            _install(*found)
