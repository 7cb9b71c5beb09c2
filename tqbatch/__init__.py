"""tqbatch: a batched TurboQuant KV cache for continuous batching on MLX, and its test harness.

The cache classes and persistence functions are imported on first use, so
that ``import tqbatch.testing.backend`` can choose MLX's precision before
mlx itself is imported (``MLX_ENABLE_TF32`` is read once).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "BatchTurboQuantKVCache",
    "BatchableTurboQuantKVCache",
    "load_batch_cache",
    "save_batch_cache",
    "__version__",
]
__version__ = "0.1.0"

_LAZY = {
    "BatchTurboQuantKVCache": "tqbatch.cache",
    "BatchableTurboQuantKVCache": "tqbatch.cache",
    "load_batch_cache": "tqbatch.persist",
    "save_batch_cache": "tqbatch.persist",
}

if TYPE_CHECKING:
    from tqbatch.cache import BatchableTurboQuantKVCache, BatchTurboQuantKVCache
    from tqbatch.persist import load_batch_cache, save_batch_cache


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tqbatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
