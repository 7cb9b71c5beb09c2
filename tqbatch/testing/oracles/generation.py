"""The K/V and queries the harness writes, generated from an op's seeds.

Everything an op needs to be replayed bit-exactly is in the op itself: K/V
and queries are ``numpy.random.default_rng(seed)`` float32 normals times a
scale (docs/ops.md). Padding must never influence outputs: wherever the
harness writes a padding slot it writes *poison* (K/V scaled by ``POISON``),
and every comparison is against references that never saw those tokens.
"""

from __future__ import annotations

import numpy as np

__all__ = ["POISON", "random_kv"]

# Scale of K/V written into padding slots. Large enough that attending to one
# poisoned slot moves an output far past the attention tolerance (see
# tqbatch.testing.oracles.tolerances: ~1e-3 at float32), small enough that mlx-vlm's
# float16 norms (max 65504) hold it at head_dim <= 256.
POISON = 16.0


def random_kv(seed: int, shape, scale: float, padded: np.ndarray | None = None):
    """float32 keys and values (B, H, T, D) from ``seed``; padded (B, T) slots poisoned."""
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal(shape) * scale).astype(np.float32)
    values = (rng.standard_normal(shape) * scale).astype(np.float32)
    if padded is not None and padded.any():
        factor = np.where(padded, POISON, 1.0).astype(np.float32)[:, None, :, None]
        keys, values = keys * factor, values * factor
    return keys, values
