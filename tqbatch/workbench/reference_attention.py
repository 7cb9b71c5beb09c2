"""What a row's attention must give: mlx-vlm's attention over its request's reference tokens.

The one reference attention of the oracles. The row's real query columns
attend the reference's tokens (dequantized for a TurboQuant reference) with a
causal mask, as a lone, unpadded request would; the bound is
``tolerances.attention_tolerance``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_vlm.models.base as vlm_base
import numpy as np

from tqbatch.testing.oracles.numpy_model import causal_mask
from tqbatch.testing.oracles.reference import to_numpy
from tqbatch.testing.oracles.tolerances import attention_tolerance

__all__ = ["attention_operands", "reference_attention"]


def reference_attention(
    queries: mx.array,
    ref_keys: np.ndarray,
    ref_values: np.ndarray,
    scale: float,
    sinks: mx.array | None = None,
    window: int | None = None,
) -> tuple[mx.array, np.ndarray]:
    """(1, Hq, N, D) queries over (H, T, D) reference tokens, the last N of them the
    queries' own: the (Hq, N, D) output (lazy) and the (N, T) mask used.

    ``window``: a sliding-window layer's width; ``sinks``: attention sinks, as the
    batch's call had them.
    """
    n = queries.shape[2]
    mask = causal_mask(n, ref_keys.shape[1] - n, [0], window)
    # Over the dequantized tokens: what attention over a TurboQuantKVCache
    # computes, by another float32 route, which attention_tolerance covers.
    out = vlm_base.scaled_dot_product_attention(
        queries,
        mx.array(ref_keys[None]).astype(queries.dtype),
        mx.array(ref_values[None]).astype(queries.dtype),
        cache=None,
        scale=scale,
        mask=mx.array(mask),
        sinks=sinks,
    )
    return out[0], mask[0, 0]


def attention_operands(
    queries: mx.array,
    got: mx.array,
    want: mx.array,
    ref_keys: np.ndarray,
    ref_values: np.ndarray,
    mask: np.ndarray,
    scale: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch's (Hq, N, D) output, the reference's, and the bound between them.

    The bound has no sink term: a sink only adds to the softmax denominator,
    shrinking every weight, so the bound without it stays an upper bound.
    """
    q = to_numpy(queries.astype(mx.float32))[0]
    tol = attention_tolerance(q, ref_keys, ref_values, mask, scale)
    return to_numpy(got.astype(mx.float32)), to_numpy(want.astype(mx.float32)), tol
