"""tqbatch: a batched TurboQuant KV cache for continuous batching on MLX, and the harness that checks it."""

from tqbatch.cache import BatchTurboQuantKVCache

__all__ = ["BatchTurboQuantKVCache", "__version__"]
__version__ = "0.1.0"
