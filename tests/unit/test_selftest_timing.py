"""The self-test's shrink time is read off one run's clock, so it is never negative."""

from __future__ import annotations

from tqbatch.testing.selfcheck.selftest import hunt


def test_the_first_report_of_a_shrinking_hunt_is_the_plain_hunts():
    # Same derandomized examples: the shrinking run meets its check's first
    # failure at the example the plain run stopped at, and shrinks after it.
    name = "RestoreLeavesEndStale"  # found at its second example, shrunk over several runs
    plain = hunt(name)
    shrunk = hunt(name, shrink=True)
    assert plain.found and shrunk.found
    # (A plain hunt's ``examples`` also counts Hypothesis's final replay of the failure.)
    assert shrunk.first_examples == plain.first_examples <= plain.examples < shrunk.examples
    assert 0 <= shrunk.first_seconds <= shrunk.seconds
    assert shrunk.shrink_seconds == shrunk.seconds - shrunk.first_seconds >= 0
