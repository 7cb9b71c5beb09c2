"""Run mlx-vlm's batched generation, and so its server, on tqbatch's batch cache.

mlx-vlm builds its own ``BatchTurboQuantKVCache`` wherever a batch runs with
TurboQuant KV quantization (``--kv-bits B --kv-quant-scheme turboquant``).
``enable()`` makes the continuous-batching path (``mlx_vlm.generate.ar._make_cache``,
through a global name of that module) build :class:`tqbatch.BatchTurboQuantKVCache`
instead, with the same ``left_padding``, ``bits``, ``key_bits`` and ``value_bits``.

Automatic prefix caching (off by default in mlx-vlm's server: ``apc_enabled``)
is not routed: ``mlx_vlm.apc`` and ``TurboQuantKVCache.prefix_cache_merge``
build mlx-vlm's class by its name in ``mlx_vlm.turboquant`` and write its
private fields (``_idx``, its packed state) into it, so swapping that name
would hand tqbatch's class state in another class's layout.

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

from mlx_vlm.generate import ar as _vlm_ar

from tqbatch.cache import FULL_PRECISION_BATCHES, BatchTurboQuantKVCache

__all__ = ["disable", "enable", "enabled", "is_enabled", "join_caches"]

_NAME = "BatchTurboQuantKVCache"
# mlx-vlm's class and join, taken before anything here can have replaced them.
_VLM_CLASS = _vlm_ar.BatchTurboQuantKVCache
_VLM_EXTEND = _vlm_ar._extend_cache
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
        _vlm_ar.BatchTurboQuantKVCache = batch_class
        _vlm_ar._extend_cache = join_caches


def disable() -> None:
    """Give mlx-vlm its own class and join back. Idempotent."""
    with _LOCK:
        _vlm_ar.BatchTurboQuantKVCache = _VLM_CLASS
        _vlm_ar._extend_cache = _VLM_EXTEND


def is_enabled() -> bool:
    """Whether mlx-vlm's batch path currently builds tqbatch's class (or a subclass)."""
    return getattr(_vlm_ar, _NAME) is not _VLM_CLASS


@contextmanager
def enabled(batch_class: type = BatchTurboQuantKVCache) -> Iterator[None]:
    """``enable(batch_class)`` for the block; on exit, the class it found is built again."""
    with _LOCK:
        found, found_join = getattr(_vlm_ar, _NAME), _vlm_ar._extend_cache
    enable(batch_class)
    try:
        yield
    finally:
        with _LOCK:
            setattr(_vlm_ar, _NAME, found)
            _vlm_ar._extend_cache = found_join
