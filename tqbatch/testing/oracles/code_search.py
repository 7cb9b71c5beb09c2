"""mlx-vlm's TurboQuant code search, in log2 steps: the code of each rotated coordinate.

mlx-vlm's ``_TurboQuantMSECodec`` (off Metal) counts the codebook midpoints a
coordinate exceeds with one comparison per midpoint: 255 graph nodes a call
at 8 bits. The harness needs the same codes for its references
(``tqbatch.testing.oracles.codec_round_trip``) and for the single caches it
writes (``tqbatch.testing.oracles.vectorized_fallback``); over ascending
midpoints a binary search finds the same count.
``tests/unit/test_codec_round_trip.py`` shows them equal.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["midpoints_below"]


def midpoints_below(midpoints: mx.array, x: mx.array) -> mx.array:
    """Per element of ``x``, how many of the ascending ``midpoints`` it exceeds (int32).

    mlx-vlm sums ``x > midpoints[m]`` over every m: 255 ops at 8 bits. Over
    ascending midpoints that predicate holds for a prefix of them, so a
    binary search for the prefix's length finds the same count in log2 steps
    (a NaN exceeds none: 0 either way). Not ``tqbatch._codec``'s search,
    which does the same: the harness is the oracle for tqbatch's cache and
    must not share the code it judges.
    """
    n = midpoints.shape[0]
    count = mx.zeros(x.shape, dtype=mx.int32)
    step = 1
    while step * 2 <= n:
        step *= 2
    while step:
        candidate = count + step  # does x exceed midpoint candidate - 1?
        inside = candidate <= n
        probe = mx.take(midpoints, mx.minimum(candidate, n) - 1)
        count = mx.where(inside & (x > probe), candidate, count)
        step //= 2
    return count
