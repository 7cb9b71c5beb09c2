"""Shrinking is bounded by test runs, not seconds: a slow machine reports what a fast one does.

Bounded in seconds, where Hypothesis's shrinker stops (and so which failure a
campaign reports, shrunk how far, and what a survey goes on to find) would
depend on the machine's speed and load.
"""

from __future__ import annotations

import time

from hypothesis.internal.conjecture import engine

from tqbatch.testing.mutants import MUTANTS
from tqbatch.testing.search.campaign import run_campaign
from tqbatch.testing.world import World

# Found within a few examples; its shrink is one of the catalogue's longest.
MUTANT = MUTANTS["FilterKeepsOneDeadColumn"]


def _report(result):
    return [(f.identity, f.ops) for f in result.failures]


def test_hypothesis_shrinks_for_at_most_the_budgeted_runs():
    result = run_campaign(MUTANT, examples=20, profile="ci", seed=0, shrink_runs=5)
    assert result.failures
    # shrink_runs counts the non-generated runs that passed: at most the budget,
    # the run that crosses it and Hypothesis's replays of the result (measured
    # 7; unbounded, this shrink takes ~260).
    assert result.shrink_runs <= 5 + 3
    # The engine's clock and bound are restored.
    assert engine.time is time and engine.MAX_SHRINKING_SECONDS == 300


def test_a_slower_machine_reports_the_same_shrunk_failure(monkeypatch):
    fast = run_campaign(MUTANT, examples=20, profile="ci", seed=0)
    apply = World.apply

    def slow_apply(self, op):
        time.sleep(0.02)  # every op 20 ms slower: about twice as slow
        return apply(self, op)

    monkeypatch.setattr(World, "apply", slow_apply)
    slow = run_campaign(MUTANT, examples=20, profile="ci", seed=0)
    assert _report(slow) == _report(fast)
    assert slow.shrink_runs == fast.shrink_runs
