"""Run mlx-lm's own model classes on TurboQuant caches.

mlx-lm's ``scaled_dot_product_attention`` (``mlx_lm.models.base``) sends any
cache with a ``bits`` attribute down its affine-quantized attention, which
TurboQuant caches cannot serve (``AttributeError: ... 'group_size'``). mlx-vlm's
function of the same name routes them to the cache's own attention. ``enable()``
makes mlx-lm's models call a route that hands TurboQuant caches to mlx-vlm's
function and every other cache to mlx-lm's original, untouched;
``make_prompt_cache`` builds the per-request caches mlx-lm's ``BatchGenerator``
batches::

    tqbatch.mlx_lm.enable()
    gen = BatchGenerator(model)
    gen.insert(prompts, caches=[tqbatch.mlx_lm.make_prompt_cache(model) for _ in prompts])

Importing this module patches nothing.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from mlx_lm.models import base as _lm_base
from mlx_lm.models import cache as _lm_cache
from mlx_vlm.models import base as _vlm_base
from mlx_vlm.turboquant import BatchTurboQuantKVCache as _VlmBatchTurboQuantKVCache
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.cache import BatchableTurboQuantKVCache, BatchTurboQuantKVCache

__all__ = [
    "batchable_class",
    "disable",
    "enable",
    "install_make_cache",
    "is_enabled",
    "make_prompt_cache",
    "routed",
]

_NAME = "scaled_dot_product_attention"
# mlx-lm's function, taken before anything here can have replaced it.
_ORIGINAL = _lm_base.scaled_dot_product_attention
_LOCK = threading.Lock()
# The caches mlx-vlm's function serves with TurboQuant attention. tqbatch's
# (single and batch) are TurboQuantKVCache subclasses; mlx-vlm's own batch
# cache is not, and crashes in mlx-lm's attention the same way.
_TURBOQUANT = (TurboQuantKVCache, _VlmBatchTurboQuantKVCache)


def _route(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's ``scaled_dot_product_attention``, with TurboQuant caches sent to mlx-vlm's.

    Every other cache gets mlx-lm's original with the same arguments.
    """
    if isinstance(cache, _TURBOQUANT):
        # Looked up per call, not bound at import, so that wrappers installed
        # on mlx-vlm's function (tests, tracing) see these calls too.
        return _vlm_base.scaled_dot_product_attention(
            queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
        )
    return _ORIGINAL(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _rebind(old, new) -> None:
    # Every mlx-lm model module binds the function into its own globals
    # (``from .base import scaled_dot_product_attention``), so patching
    # ``mlx_lm.models.base`` alone reaches only modules imported later. Modules
    # are matched by identity, not by name: any module that bound mlx-lm's
    # function (a custom model outside mlx_lm included) is routed, nothing else
    # is touched. ``vars()`` skips module-level ``__getattr__`` hooks.
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(_NAME) is old:
            setattr(module, _NAME, new)


def enable() -> None:
    """Route mlx-lm's attention of TurboQuant caches to the caches' own attention.

    Rebinds ``scaled_dot_product_attention`` in ``mlx_lm.models.base`` and in
    every imported module holding mlx-lm's function; modules imported later
    take the route from ``base``. Idempotent, not reference-counted: enabling
    twice is enabling once, and one ``disable()`` undoes it (``routed()``
    nests by restoring the state it found).
    """
    with _LOCK:
        _rebind(_ORIGINAL, _route)


def disable() -> None:
    """Restore mlx-lm's original function in every module holding the route.

    That includes modules first imported while the route was enabled.
    Idempotent.
    """
    with _LOCK:
        _rebind(_route, _ORIGINAL)


def is_enabled() -> bool:
    """Whether ``mlx_lm.models.base`` currently holds the route."""
    return _lm_base.scaled_dot_product_attention is _route


@contextmanager
def routed() -> Iterator[None]:
    """``enable()`` for the block; on exit, disable only if it was not enabled before."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()


_MISSING = object()


def _own_caches(model, max_kv_size):
    """The caches the model makes itself, as mlx-lm's ``make_prompt_cache`` returns them.

    Where ``install_make_cache`` replaced the model's ``make_cache``, the one
    it replaced (the class's, or none) is used, so the factory never calls
    itself.
    """
    make = getattr(model, "make_cache", None)
    installed = getattr(make, "_tqbatch_replaced", _MISSING)
    if installed is _MISSING:
        return _lm_cache.make_prompt_cache(model, max_kv_size)
    if installed is not None:
        return installed()
    n = len(model.layers)
    if max_kv_size is not None:
        return [_lm_cache.RotatingKVCache(max_size=max_kv_size, keep=4) for _ in range(n)]
    return [_lm_cache.KVCache() for _ in range(n)]


_BATCHABLE: dict[type, type] = {BatchTurboQuantKVCache: BatchableTurboQuantKVCache}


def batchable_class(batch_class: type) -> type:
    """The single-request cache class whose ``merge`` builds a ``batch_class``.

    mlx-lm's ``BatchGenerator`` picks the batch class by calling ``merge`` on
    the first request's cache, so running another batch class (a subclass of
    tqbatch's, a test double) needs single caches that merge into it. For
    tqbatch's own class that is ``BatchableTurboQuantKVCache``; any other gets
    one subclass of it, made once.
    """
    if batch_class not in _BATCHABLE:
        _BATCHABLE[batch_class] = type(
            f"Batchable{batch_class.__name__}",
            (BatchableTurboQuantKVCache,),
            {
                "merge": classmethod(lambda cls, caches: batch_class.merge(caches)),
                "__doc__": f"A BatchableTurboQuantKVCache merging into {batch_class.__name__}.",
            },
        )
    return _BATCHABLE[batch_class]


def make_prompt_cache(
    model,
    *,
    bits: float = 4.0,
    key_bits: float | None = None,
    value_bits: float | None = None,
    seed: int = 0,
    dense_layers: Sequence[int] = (),
    max_kv_size: int | None = None,
    batch_class: type = BatchTurboQuantKVCache,
) -> list:
    """One request's per-layer caches for an mlx-lm model, full-attention layers TurboQuant.

    Starts from ``mlx_lm.models.cache.make_prompt_cache(model, max_kv_size)``
    (the model's own ``make_cache()`` where it has one) and replaces each plain
    full-attention ``KVCache`` (exact type) with a ``BatchableTurboQuantKVCache``
    of this configuration, except at ``dense_layers``. Every other cache
    (``RotatingKVCache`` of sliding-window layers, ``ArraysCache`` /
    ``MambaCache`` of linear-attention layers, ``ChunkedKVCache``, ...) is
    kept as the model made it. ``BatchGenerator`` merges the TurboQuant ones
    into a ``tqbatch.BatchTurboQuantKVCache``; attention needs ``enable()``.
    Models that read the cache's keys themselves (multi-head latent attention,
    e.g. ``deepseek_v3``) cannot attend over TurboQuant's packed state.
    ``batch_class``: the batch cache the TurboQuant layers merge into
    (``batchable_class``); tqbatch's by default.
    """
    dense = set(dense_layers)
    single = batchable_class(batch_class)
    caches = _own_caches(model, max_kv_size)
    return [
        single(bits=bits, seed=seed, key_bits=key_bits, value_bits=value_bits)
        if type(c) is _lm_cache.KVCache and i not in dense
        else c
        for i, c in enumerate(caches)
    ]


def install_make_cache(model, **config):
    """Give ``model`` a ``make_cache()`` returning ``make_prompt_cache(model, **config)``.

    ``make_cache`` is the hook mlx-lm itself calls: ``BatchGenerator.insert``
    for a request inserted without caches, and ``mlx_lm.server`` (through
    ``make_prompt_cache(model)``) both to decide whether the model can be
    batched and to start each request. Installing again replaces the
    configuration. Returns ``model``.
    """
    previous = getattr(model, "make_cache", None)
    replaced = getattr(previous, "_tqbatch_replaced", previous)
    make_prompt_cache(model, **config)  # refuse a bad configuration now, not per request

    def make_cache():
        return make_prompt_cache(model, **config)

    make_cache._tqbatch_replaced = replaced
    model.make_cache = make_cache
    return model
