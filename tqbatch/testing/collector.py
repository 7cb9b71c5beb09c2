"""Collecting an op's check failures, and settling them once every check has run.

Every check of an op runs whatever the others found: the failures are kept
while the op's checks run (``collecting``) and settled afterwards
(``settle``): the first one not tolerated is raised, carrying the others
(``CheckFailure.also``); tolerated ones are kept; where only tolerated ones
failed and one of them diverged the target, ``ToleratedDivergence`` ends the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from tqbatch.testing.contract.checks import Check, CheckFailure, ToleratedDivergence, failure

__all__ = ["FailureCollector"]


class FailureCollector:
    """The failures of the op being checked. ``checks``: the catalogue the checks reported
    by name are found in (``tqbatch.testing.contract.ops.CHECKS``); ``tolerate``: a
    predicate on ``CheckFailure``s to note instead of raise (a survey passes "already
    reported"); ``tolerated``: those seen so far."""

    def __init__(
        self, checks: dict[str, Check], tolerate: Callable[[CheckFailure], bool] | None = None
    ):
        self.checks = checks
        self.tolerate = tolerate
        self.tolerated: list[CheckFailure] = []
        # While an op's checks run: the failures found so far. None: settle at once.
        self._found: list[CheckFailure] | None = None

    def report(self, check: str, op, what: str) -> None:
        """The ``CheckFailure`` of ``check``: kept with the op's failures (inside
        ``collecting``), or settled at once."""
        exc = failure(self.checks[check], op, what)
        if self._found is not None:
            self._found.append(exc)
            return
        self.settle([exc])

    def stop(self, check: str, op, what: str) -> None:
        """Report a diverging failure after which nothing more of the op can be evaluated:
        settles the op's failures now, this one last (raises, tolerated or not)."""
        found = self._found if self._found is not None else []
        found.append(failure(self.checks[check], op, what))
        self.settle(found)

    @contextlib.contextmanager
    def collecting(self):
        """Keep the failures reported inside (nested: in the same list); yields the list."""
        outer = self._found
        if outer is None:
            self._found = []
        try:
            yield self._found
        finally:
            self._found = outer

    def tolerated_failure(self, exc: CheckFailure) -> bool:
        return self.tolerate is not None and self.tolerate(exc)

    def would_stop(self, found: list[CheckFailure]) -> bool:
        """Whether settling ``found`` would raise: a failure not tolerated, or one diverged."""
        return any(not self.tolerated_failure(f) or f.check.diverged for f in found)

    def settle(self, found: list[CheckFailure]) -> None:
        """Raise what the op's failures call for; return where all are tolerated and none
        diverged.

        One failure per identity (the first found: a check may fail on
        several rows or masks). The first that is not tolerated is raised,
        carrying every other one not tolerated (``also``, each its own
        identity, listed in a note).
        """
        first_of: dict[str, CheckFailure] = {}
        for f in found:
            first_of.setdefault(f.identity, f)
        unique = list(first_of.values())
        raised = [f for f in unique if not self.tolerated_failure(f)]
        self.tolerated.extend(f for f in unique if self.tolerated_failure(f))
        if raised:
            first = raised[0]
            first.also = raised[1:]
            if first.also:
                first.add_note(
                    "also failing after this op:\n"
                    + "\n".join(f"  {f.identity}: {f.what}" for f in first.also)
                )
            raise first
        diverged = [f for f in unique if f.check.diverged]
        if diverged:
            raise ToleratedDivergence(diverged[0])
