"""mlx-vlm's Lloyd-Max codebooks, solved by the same arithmetic in an eighth of the time.

Every TurboQuant codec takes its codebook from mlx-vlm's ``_codebook(dim,
bits)``: a Lloyd-Max solve over a 32,768-point grid, up to 100 rounds, each
round a boolean mask over the whole grid per level (256 levels at 8 bits).
It is cached per process, but a process of the harness draws about 30
(head dim, width) pairs, and every survey process pays them again: about
4 s of a 150-example campaign on a 2-core CPU, 0.5 s for one 8-bit codebook.

The grid is ascending, so each level's bucket is one contiguous run of it,
found by ``searchsorted`` on the boundaries. :func:`solve` sums each run as
a slice where mlx-vlm sums the masked copy of the same run: the same values
in the same order, through the same numpy reduction, so every centroid is
the same float32, bit for bit (``tests/unit/test_codebooks.py``, every
width at each head dim the harness draws); the weights are mlx-vlm's own
``_beta_pdf``. A round costs the levels' slices instead of the levels'
masks.

:func:`fast_codebooks` puts :func:`solve` in place of ``_codebook`` for a
``with`` block: every codec built inside it, the target's included, gets
the same codebook it would have had. It does so only while mlx-vlm's
function is the one :func:`solve` was checked against (its source, by
digest); another mlx-vlm keeps its own solve.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from collections.abc import Iterator
from unittest import mock

import mlx.core as mx
import numpy as np
from mlx_vlm import turboquant

__all__ = ["fast_codebooks", "matches_mlx_vlm", "solve"]

# sha256 of the source of the ``_codebook`` that solve() reproduces (mlx-vlm
# 0.7.10's); see matches_mlx_vlm.
_SOLVED_SOURCE = "5188134c42b591c6787c4ad890eb9daaf04b3b6ef913eaa61d8991f628a74e92"

_GRID_POINTS = 32768
_ROUNDS = 100
_CONVERGED = 1e-6


@functools.cache
def solve(dim: int, bits: int) -> mx.array:
    """The (2**bits,) float32 codebook mlx-vlm's ``_codebook(dim, bits)`` returns."""
    if bits <= 0:
        return mx.zeros((0,), dtype=mx.float32)
    levels = 1 << bits
    if dim <= 1:
        return mx.array(np.linspace(-1.0, 1.0, levels, dtype=np.float32))
    grid = np.linspace(-1.0 + 1e-6, 1.0 - 1e-6, _GRID_POINTS, dtype=np.float32)
    weights = turboquant._beta_pdf(grid, dim)
    cdf = np.cumsum(weights)
    quantiles = (np.arange(levels, dtype=np.float32) + 0.5) / levels
    centroids = np.interp(quantiles, cdf, grid).astype(np.float32)
    # A run's weighted mean depends on the run alone; near convergence most
    # runs come back unchanged round after round.
    means: dict[tuple[int, int], np.float32 | None] = {}
    for _ in range(_ROUNDS):
        boundaries = np.empty(levels + 1, dtype=np.float32)
        boundaries[0] = -1.0
        boundaries[-1] = 1.0
        boundaries[1:-1] = 0.5 * (centroids[:-1] + centroids[1:])
        # Level i holds grid >= boundaries[i] and < boundaries[i + 1] (the
        # last level <= its upper boundary): a run [starts[i], ends[i]).
        starts = np.searchsorted(grid, boundaries[:-1], side="left")
        ends = np.searchsorted(grid, boundaries[1:], side="left")
        ends[-1] = np.searchsorted(grid, boundaries[-1], side="right")
        new_centroids = centroids.copy()
        for i in np.flatnonzero(ends > starts).tolist():
            run = (int(starts[i]), int(ends[i]))
            if run not in means:
                means[run] = _weighted_mean(grid, weights, slice(*run))
            if means[run] is not None:
                new_centroids[i] = means[run]
        converged = np.max(np.abs(new_centroids - centroids)) < _CONVERGED
        centroids = new_centroids
        if converged:
            break
    return mx.array(centroids.astype(np.float32))


def _weighted_mean(grid: np.ndarray, weights: np.ndarray, run: slice) -> np.float32 | None:
    """The centroid of a bucket as mlx-vlm computes it, or None where it weighs nothing."""
    bucket_weights = weights[run]
    total_weight = bucket_weights.sum()
    if total_weight > 0:
        return np.sum(bucket_weights * grid[run]) / total_weight
    return None


def _source_digest(function) -> str:
    source = inspect.getsource(inspect.unwrap(function))
    return hashlib.sha256(source.encode()).hexdigest()


@functools.cache
def matches_mlx_vlm() -> bool:
    """Whether the installed mlx-vlm's ``_codebook`` is the one :func:`solve` reproduces."""
    try:
        return _source_digest(turboquant._codebook) == _SOLVED_SOURCE
    except (OSError, TypeError):  # no source to read (a frozen or compiled install)
        return False


@contextlib.contextmanager
def fast_codebooks() -> Iterator[None]:
    """Codecs built inside take their codebooks from :func:`solve` (where it matches)."""
    if not matches_mlx_vlm():
        yield
        return
    with mock.patch.object(turboquant, "_codebook", solve):
        yield
