"""tqbatch: a batched TurboQuant KV cache for continuous batching on MLX, and its test harness."""

from tqbatch.cache import BatchableTurboQuantKVCache, BatchTurboQuantKVCache
from tqbatch.persist import load_batch_cache, save_batch_cache

__all__ = [
    "BatchTurboQuantKVCache",
    "BatchableTurboQuantKVCache",
    "load_batch_cache",
    "save_batch_cache",
    "__version__",
]
__version__ = "0.1.0"
