"""Which codes and norms float rounding lets a correct quantizer choose.

TurboQuant stores a token as a float16 norm and, per coordinate of the
rotated unit vector, the index of the codebook interval it falls in. Two
correct implementations compute the norm, the division and the rotation in
float32 in different orders (another batch shape, another kernel, a GPU), so
where the exact rotated coordinate lies within rounding of a codebook
midpoint, or the exact norm within rounding of a float16 rounding boundary,
they may store different codes or norms for the same token. On the CPU the
two routes the harness compares happen to agree bit for bit; on a GPU they
did not (one coordinate in tens of thousands). The contract is the set of
choices rounding allows, not one of them.

:class:`AdmissibleCodes` computes, in float64 from the token that entered the
cache, the exact code of every coordinate and the neighbour rounding may pick
instead, and the float16 norms rounding may produce; :meth:`admits` says
whether a cache's dequantized token is the dequantization of such a choice.
A real bug (a wrong, stale, shifted or padding token; a wrong codec) moves
most coordinates by whole codebook intervals and stays rejected; only a
difference rounding can produce is admitted.

The rounding band (:func:`rotation_error`): each route computes the norm
(a D-term inner product), the unit vector (one division) and the rotation
(a D-term inner product of a unit vector with a unit column), so each
rotated coordinate is off the exact one by at most ``2·e`` with
``e = inner_product_error(D + 1)`` (``tqbatch.testing.oracles.tolerances``). Two
routes can choose different codes only where the exact value is within that
of a midpoint. In numbers at D = 128: 1.1e-5 at float32, against codebook
intervals of 2.2e-2 to 5.7e-2 at 4 bits and 8.5e-4 to 4.1e-2 at 8 bits;
3.9e-3 at TF32, where at 8 bits most central coordinates may move by one
interval (and no further).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tqbatch.testing.oracles.tolerances import inner_product_error

__all__ = ["AdmissibleCodes", "rotation_error"]


def rotation_error(dim: int, precision: str | None = None) -> float:
    """Bound on one route's error in a rotated unit coordinate (see the module docstring)."""
    return 2.0 * inner_product_error(dim + 1, precision)


class AdmissibleCodes:
    """The dequantized tokens rounding allows for one codec, computed in float64."""

    def __init__(self, codec, precision: str | None = None):
        dim = codec.dim
        # forward(x) = x @ forward: the codec's own rotation of the unit vectors.
        self.forward = np.array(codec._rotate_forward(mx.eye(dim, dtype=mx.float32)), np.float64)
        self.codebook = np.array(codec.codebook, np.float64)
        self.midpoints = np.array(codec._midpoints, np.float64)
        self.band = rotation_error(dim, precision)

    def choices(self, tokens: np.ndarray):
        """Per token of ``tokens`` (..., D): (norms (..., 2), codes (..., D), alternatives).

        ``norms`` holds the float16 values a float32 norm may round to (twice
        the same value where only one is possible); ``codes`` the exact codes;
        ``alternatives`` the neighbouring code where the exact coordinate is
        within the rounding band of a midpoint, else the code itself.
        """
        x = np.asarray(tokens, np.float64)
        norm = np.sqrt(np.sum(x * x, axis=-1))
        slack = norm * self.band
        norms = np.stack(
            [(norm - slack).astype(np.float16), (norm + slack).astype(np.float16)], axis=-1
        ).astype(np.float64)
        unit = x / np.maximum(norm, 1e-30)[..., None]
        rotated = unit @ self.forward
        codes = np.searchsorted(self.midpoints, rotated, side="left")
        alternatives = codes.copy()
        if self.midpoints.size:
            # The midpoint just below and just above each coordinate.
            below = np.clip(codes - 1, 0, self.midpoints.size - 1)
            above = np.clip(codes, 0, self.midpoints.size - 1)
            near_below = (codes > 0) & (rotated - self.midpoints[below] <= self.band)
            near_above = (codes < self.midpoints.size) & (
                self.midpoints[above] - rotated <= self.band
            )
            alternatives = np.where(near_below, codes - 1, alternatives)
            alternatives = np.where(near_above, codes + 1, alternatives)
        return norms, codes, alternatives

    def admits(self, got: np.ndarray, tokens: np.ndarray, tol: np.ndarray) -> np.ndarray:
        """Which of ``got``'s tokens (..., D) dequantize a choice rounding allows.

        ``got``: a cache's dequantized tokens; ``tokens``: the tokens that
        entered it (same shape); ``tol``: the per-token bound on two float32
        dequantizations of the same codes (``content_tolerance``, (..., 1)).
        Returns a boolean array of shape ``got.shape[:-1]``.
        """
        norms, codes, alternatives = self.choices(tokens)
        # Back in the codec's basis: a dequantized token is norm * codebook[code].
        rotated = np.asarray(got, np.float64) @ self.forward
        # ``tol`` bounds each coordinate's rounding error with the
        # probabilistic model of tqbatch.testing.oracles.tolerances (independent
        # errors, LAMBDA deviations). A rotated coordinate is an inner product
        # of that error vector with a unit column, so under the same model
        # its error has the same spread and ``tol`` bounds it too. (The
        # worst case, Cauchy-Schwarz's sqrt(D) * tol, is at TF32 as wide as a
        # 4-bit codebook cell times the norm, 0.5 against 0.24-0.63 at norm
        # 11, and admitted full-precision tokens on an H200.)
        tol = np.asarray(tol, np.float64)
        admitted = np.zeros(rotated.shape[:-1], bool)
        for k in range(2):
            norm = norms[..., k : k + 1]
            fits = np.abs(rotated - norm * self.codebook[codes]) <= tol
            fits |= np.abs(rotated - norm * self.codebook[alternatives]) <= tol
            admitted |= fits.all(axis=-1)
        return admitted
