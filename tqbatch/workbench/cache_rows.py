"""What a cache holds for each request, read as float32 numpy: the one reader of the oracles.

A batch cache's row ``b`` holds ``left_padding[b]`` dead slots and then its
request's tokens up to the written end; a single-request cache holds its
request's tokens from slot 0. Quantized caches are read through their
``dequantize()``, full-precision ones through their arrays up to the end.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as lm_cache
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.testing.oracles.reference import to_numpy

__all__ = ["FULL_PRECISION_BATCHES", "ints", "read_row", "read_rows", "read_single"]

FULL_PRECISION_BATCHES = (lm_cache.BatchKVCache, vlm_cache.BatchKVCache)

Tokens = tuple[np.ndarray, np.ndarray]  # (H, T, D) float32 keys and values


def ints(x) -> list[int]:
    """An MLX array, numpy array or sequence of integers as a flat list of ints."""
    return [int(v) for v in np.asarray(np.array(x)).reshape(-1).tolist()]


def read_rows(cache) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(B, H, T, D) float32 keys and values of a batch cache's written slots, and its
    left padding."""
    if isinstance(cache, FULL_PRECISION_BATCHES):
        end = int(cache._idx)
        keys, values = cache.keys[..., :end, :], cache.values[..., :end, :]
    else:
        keys, values = cache.dequantize()
    padding = ints(cache.left_padding)
    return to_numpy(keys.astype(mx.float32)), to_numpy(values.astype(mx.float32)), padding


def read_single(cache) -> Tokens | None:
    """A single-request cache's tokens; None where it holds none."""
    if cache.keys is None or int(cache.offset) == 0:
        return None
    if isinstance(cache, TurboQuantKVCache):
        keys, values = cache.dequantize()
    else:
        n = int(cache.offset)
        keys, values = cache.keys[..., :n, :], cache.values[..., :n, :]
    return to_numpy(keys.astype(mx.float32))[0], to_numpy(values.astype(mx.float32))[0]


def read_row(cache, index: int) -> Tokens | None:
    """Row ``index``'s tokens as a batch cache holds them, or a single cache's."""
    if hasattr(cache, "left_padding"):
        keys, values, padding = read_rows(cache)
        return keys[index, :, padding[index] :], values[index, :, padding[index] :]
    return read_single(cache)
