"""What the state machine saw over a run's examples: how often each op ran, what failed.

Hypothesis makes a ``BatchCacheMachine`` per example, so what outlives an
example is kept here: ``machine_for`` binds one ``MachineObserver`` to the
machine class it makes (a fresh one unless one is handed in), and every
example reports to it. A campaign (``tqbatch.testing.search.campaign``) or a mutant
hunt (``tqbatch.testing.selfcheck.selftest``) makes its own and reads it; two machines
with their own observers share nothing. A failed example is recorded as a
``tqbatch.testing.contract.failure.Failure``, the record a campaign hands on.
"""

from __future__ import annotations

from tqbatch.testing.contract.failure import Failure

__all__ = ["MachineObserver"]


class MachineObserver:
    """Op counts and failures reported by the examples of a machine.

    ``op_counts``: op name -> how often it ran; ``pair_counts``: (op, next op)
    -> how often the one followed the other in an example; ``failures``:
    identity (or, for anything but a failed check, the message) -> the last
    ``Failure`` recorded with it, which after a Hypothesis run is each
    distinct bug's shrunk example; ``last_failure``: the last recorded.
    """

    def __init__(self):
        self.op_counts: dict[str, int] = {}
        self.pair_counts: dict[tuple[str, str], int] = {}
        self.failures: dict[str, Failure] = {}
        self.last_failure: Failure | None = None

    def op_ran(self, previous: str | None, name: str) -> None:
        """Op ``name`` ran, after op ``previous`` of the same example (None: the first)."""
        self.op_counts[name] = self.op_counts.get(name, 0) + 1
        if previous is not None:
            pair = (previous, name)
            self.pair_counts[pair] = self.pair_counts.get(pair, 0) + 1

    def failed(self, failure: Failure) -> None:
        """An example failed: ``failure`` is its record."""
        self.last_failure = failure
        self.failures[failure.key] = failure

    def clear_failures(self) -> None:
        """Forget the failures recorded so far (the counts are kept)."""
        self.failures.clear()
        self.last_failure = None

    def counts(self) -> tuple[dict, dict]:
        """Copies of ``op_counts`` and ``pair_counts`` as they are now."""
        return dict(self.op_counts), dict(self.pair_counts)

    def counts_since(self, before: tuple[dict, dict]) -> tuple[dict, dict]:
        """The op and pair counts added since ``before`` (a ``counts()``), zeros left out."""
        ops_before, pairs_before = before
        ops = {k: v - ops_before.get(k, 0) for k, v in self.op_counts.items()}
        pairs = {k: v - pairs_before.get(k, 0) for k, v in self.pair_counts.items()}
        return {k: v for k, v in ops.items() if v}, {k: v for k, v in pairs.items() if v}
