"""The judges: every comparison of a cache's numbers with a reference, in one family.

A judge compares what a cache yields (``got``) with what its reference says
(``want``) within a per-element bound (``tol``, derived in
``tqbatch.testing.oracles.tolerances``), and returns a ``Judgement``: the worst
``|got - want| / tol`` and, where that is past 1, one failure sentence in one
shape (``Judgement.detail``). The same functions judge for the state machine
(``tqbatch.testing.contract.invariants`` and the op modules), and for the workbench's
request oracle (the model matrix and ``tqbatch e2e``).

Rounding admission is part of judging: a quantizer may legitimately pick
another code or float16 norm where float rounding puts a coordinate on a
bucket boundary. ``judge`` takes an ``admit`` callable that lets the
reference take the cache's choice (``TurboReferences.admit_rounding``);
where it took any, the operands are built again and judged once more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tqbatch.testing.backend import matmul_precision
from tqbatch.testing.oracles.tolerances import content_tolerance, excess_ratios

__all__ = ["Judgement", "compare", "judge", "judge_tokens"]

Operands = tuple[np.ndarray, np.ndarray, np.ndarray]  # got, want, tol


@dataclass(eq=False)
class Judgement:
    """``got`` against ``want`` within ``tol``; ``ratios``: ``|got - want| / tol`` per element."""

    got: np.ndarray
    want: np.ndarray
    tol: np.ndarray
    ratios: np.ndarray

    @property
    def ratio(self) -> float:
        """The worst ratio (0 for empty operands; NaN or inf where ``got`` is not finite)."""
        return float(self.ratios.max()) if self.ratios.size else 0.0

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0  # NaN compares False: a non-finite output fails

    @property
    def worst_at(self) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(np.argmax(self.ratios), self.ratios.shape))

    def bad(self, axis: int) -> list[int]:
        """Indices along ``axis`` (e.g. tokens of an (H, T, D) row) with an element past ``tol``."""
        outside = ~(self.ratios <= 1.0)
        other = tuple(a for a in range(outside.ndim) if a != axis)
        return np.argwhere(outside.any(axis=other))[:, 0].tolist()

    def detail(self) -> str | None:
        """None where passed; else the one failure shape:
        ``by D (bound B at P precision; R x the tolerance at INDEX)``."""
        if self.passed:
            return None
        at = self.worst_at
        diff = abs(float(self.got[at]) - float(self.want[at]))
        bound = float(np.broadcast_to(self.tol, self.ratios.shape)[at])
        return (
            f"by {diff:.3g} (bound {bound:.3g} at {matmul_precision()} precision; "
            f"{self.ratio:.3g}x the tolerance at {at})"
        )


def compare(got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> Judgement:
    """``got`` against ``want`` (same shape) within ``tol`` (broadcast)."""
    if _identical(got, want):
        return _exact(got, want)
    return Judgement(got, want, tol, excess_ratios(got, want, tol))


def _identical(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether ``got`` and ``want`` hold the same numbers (NaN is never identical)."""
    return got.shape == want.shape and np.array_equal(got, want)


def _exact(got: np.ndarray, want: np.ndarray) -> Judgement:
    """The judgement of identical operands: every ratio 0, whatever the tolerance.

    Where both routes compute in the same order (float32 on one CPU) a
    correct cache's numbers are the reference's bit for bit, so most
    comparisons end here without the float64 ratios or the tolerance.
    """
    return Judgement(got, want, np.zeros((1,) * got.ndim), np.zeros(got.shape))


def judge(operands: Callable[[], Operands], admit: Callable[[], bool] | None = None) -> Judgement:
    """Judge ``operands()``; where that fails and ``admit()`` lets the reference take the
    cache's rounding choices (returns whether it took any), judge ``operands()`` again."""
    judgement = compare(*operands())
    if not judgement.passed and admit is not None and admit():
        judgement = compare(*operands())
    return judgement


def judge_tokens(
    got: np.ndarray,
    want: Callable[[], np.ndarray],
    admit: Callable[[np.ndarray], bool] | None = None,
) -> Judgement:
    """A request's (H, T, D) tokens as a cache holds them against its reference ``want()``,
    within ``content_tolerance``; ``admit(tol)`` as in ``judge``."""

    reference = want()
    if _identical(got, reference):  # the tolerance is not needed
        return _exact(got, reference)

    def operands():
        reference = want()
        return got, reference, content_tolerance(reference)

    take = None if admit is None else (lambda: admit(content_tolerance(want())))
    return judge(operands, take)
