"""The harness against its own mutant catalogue: is each bug found, by its check, how fast.

``hunt(name)`` runs the state machine against mutant ``name`` under a
Hypothesis profile (``ci`` by default: derandomized, so the same examples on
every run) and counts the mutant as found only when the check it names
(``tqbatch.testing.mutants.CATCHES``) fails; every other failure is tolerated
(run past, or the example goes on with a fresh cache where the target has
diverged). With
``shrink=True`` the failure is also shrunk, as ``tqbatch fuzz`` reports it.

``python -m tqbatch.testing.selfcheck.selftest [--markdown]`` hunts every mutant and
prints the table docs/search-speed.md carries (time to the first report, examples,
shrink time and shrunk length). Timings are measurements, reported by the
perf suite (``tests/perf/test_search_speed.py``), never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, replace

from hypothesis import Phase, settings

from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.mutants import CATCHES, MUTANTS
from tqbatch.testing.search.campaign import MINIMIZE_REPLAYS, SHRINK_RUNS
from tqbatch.testing.search.hypothesis_internals import (
    RunClock,
    no_local_constants,
    shrink_budget,
)
from tqbatch.testing.search.machine_observer import MachineObserver
from tqbatch.testing.search.minimize import minimize
from tqbatch.testing.search.profiles import PROFILES
from tqbatch.testing.search.stateful import UnsupportedOpsWarning, machine_for

__all__ = ["Hunt", "hunt", "main"]


@dataclass
class Hunt:
    """One search: what was found (None: nothing), after how long and how many examples.

    ``seconds`` is the whole search, shrinking included where it shrank;
    ``first_seconds`` and ``first_examples`` are when its check first failed
    (None: it never did), in the same run, so that a shrink's time is the
    difference of two readings of one clock.
    """

    mutant: str
    check: str
    failure: Failure | None
    seconds: float
    examples: int
    first_seconds: float | None = None
    first_examples: int | None = None

    @property
    def shrink_seconds(self) -> float | None:
        """The time from the first failure of its check to the reported repro."""
        return None if self.first_seconds is None else self.seconds - self.first_seconds

    @property
    def found(self) -> bool:
        return self.failure is not None and self.failure.check == self.check


def hunt(name: str, *, profile: str | settings = "ci", shrink: bool = False) -> Hunt:
    """Search mutant ``name`` until its check fails (or the profile's budget is spent).

    ``profile``: a profile of ``tqbatch.testing.search.profiles`` or a settings object.
    """
    intended = CATCHES[name]
    observer = MachineObserver()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsupportedOpsWarning)
        machine = machine_for(
            MUTANTS[name],
            tolerate=lambda failure: failure.check.name != intended,
            observer=observer,
        )
    examples = [0]
    first: list = [None, None]  # seconds and examples when the check first failed
    clock = RunClock()
    start = time.perf_counter()

    class Counting(machine):
        def __init__(self):
            super().__init__()
            clock.tick()

        def teardown(self):
            examples[0] += 1
            failure = observer.last_failure  # recorded before teardown
            if first[0] is None and failure is not None and failure.check == intended:
                first[:] = [time.perf_counter() - start, examples[0]]

    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    base = PROFILES[profile] if isinstance(profile, str) else profile
    # One failure, shrunk: the check may fail after several ops (distinct
    # identities), and the first report is what a user waits for.
    Counting.TestCase.settings = settings(
        base, phases=phases, print_blob=False, report_multiple_bugs=False
    )
    try:
        # As tqbatch fuzz shrinks, and draws no constants from local code.
        with shrink_budget(SHRINK_RUNS, clock), no_local_constants():
            Counting.TestCase("runTest").runTest()
    except AssertionError:
        pass  # the machine recorded what failed
    failure = observer.last_failure
    if shrink and failure is not None and failure.check == intended:
        # As tqbatch fuzz reports it: Hypothesis's shrink, then the op-level pass.
        ops, check_failure = minimize(
            MUTANTS[name],
            failure.config,
            failure.ops,
            failure.identity,
            lambda f: f.check.name != intended,
            replays=MINIMIZE_REPLAYS,
        )
        if check_failure is not None:
            failure = replace(failure, ops=ops, message=str(check_failure))
    seconds = time.perf_counter() - start
    return Hunt(name, intended, failure, seconds, examples[0], *first)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tqbatch.testing.selfcheck.selftest")
    parser.add_argument("--profile", default="ci")
    parser.add_argument(
        "--markdown", action="store_true", help="print the table of docs/search-speed.md"
    )
    parser.add_argument("mutants", nargs="*", help="default: the whole catalogue")
    args = parser.parse_args(argv)
    names = args.mutants or sorted(MUTANTS)
    rows, found_times = [], []
    for name in names:
        # One run: its first failure of the check, then the shrink of it.
        found = hunt(name, profile=args.profile, shrink=True)
        if found.found:
            found_times.append(found.first_seconds)
        rows.append(
            (
                name,
                found.check,
                f"{found.first_seconds:.1f}" if found.found else "not found",
                str(found.first_examples) if found.found else str(found.examples),
                f"{found.shrink_seconds:.1f}" if found.found else "-",
                str(len(found.failure.ops)) if found.found else "-",
            )
        )
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)  # progress
    head = ("mutant", "caught by", "first report (s)", "examples", "shrinking (s)", "shrunk ops")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    if found_times:
        print(
            f"\n{len(found_times)}/{len(names)} found by their check; first report: median "
            f"{statistics.median(found_times):.1f} s, worst {max(found_times):.1f} s "
            f"(profile {args.profile})"
        )
    return 0 if len(found_times) == len(names) else 1


if __name__ == "__main__":
    raise SystemExit(main())
