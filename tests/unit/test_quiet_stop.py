"""A survey that ends soon after its last find, and one that steers around known failures."""

from __future__ import annotations

import pytest

from tqbatch.testing.gate.known_failures import KnownFailures, shipped
from tqbatch.testing.search.campaign import contract_identities, quiet_stop_round, run_campaign
from tqbatch.testing.search.shards import run_in_processes
from tqbatch.testing.target import load_impl

from .support import campaign_summary

MUTANT = "tqbatch.testing.mutants:HasIdxAttribute"  # found in its first examples
CAMPAIGN = dict(profile="ci", survey=True)

A, B = frozenset({"a@x"}), frozenset({"a@x", "b@y"})
A2 = frozenset({"a@x", "a@z"})  # check a again, after another op
C = frozenset({"a@x", "b@y", "c@w"})


@pytest.mark.parametrize(
    ("found_after", "quiet", "stop"),
    [
        ([frozenset()] * 10, 3, None),  # nothing found: the whole budget
        ([A] * 10, None, None),  # no quiet rule
        ([A] * 10, 0, None),
        ([A, A, A], 3, None),  # found in round 1: three quiet rounds end after round 4
        ([A, A, A, A], 3, 4),
        ([frozenset(), A, A, A, A, A], 3, 5),
        ([frozenset(), A, B, B, B, B, B], 3, 6),  # a new find in round 3 starts the count again
        ([frozenset(), A, B, B, B], 3, None),
        ([A, A, A2, A2], 3, 4),  # a known check after another op: kept, no new count
        ([frozenset(), A, A2, B, B, B, B], 3, 7),
        # At the latest, twice the first find's round plus the quiet rounds: new checks
        # found every other round do not keep a red survey going to its budget.
        ([A, A, B, B, B, B, B], 3, 5),
        ([frozenset(), A, A, B, B, C, C, C, C], 3, 7),
        ([frozenset()] * 3 + [A] * 20, 6, 10),  # the default 6: quiet after round 10
    ],
)
def test_the_stop_round_counts_rounds_with_nothing_new_after_a_find(found_after, quiet, stop):
    assert quiet_stop_round(found_after, quiet) == stop


def test_a_failing_target_stops_for_quiet_and_keeps_its_finds():
    impl = load_impl(MUTANT)
    result = run_campaign(impl, examples=200, seed=0, quiet_rounds=2, **CAMPAIGN)
    assert result.quiet_stop
    assert "structure" in contract_identities(result)
    assert result.examples < 200
    whole = run_campaign(impl, examples=result.examples + 10, seed=0, **CAMPAIGN)
    assert not whole.quiet_stop and whole.examples == result.examples + 10


def test_a_correct_target_runs_its_whole_budget():
    result = run_campaign(load_impl("tqbatch"), examples=12, seed=0, quiet_rounds=1, **CAMPAIGN)
    assert not result.quiet_stop and result.examples == 12


def test_policy_differences_and_listed_failures_do_not_stop_it():
    """mlx-vlm's class with its shipped list: every contract failure is listed (tolerated from
    the start, noted as seen), the rest are policy differences: the whole budget runs."""
    listed = KnownFailures.load(shipped("mlx_vlm_0_7_10")).entries
    result = run_campaign(
        load_impl("mlx-vlm"), examples=15, seed=0, quiet_rounds=1, listed=listed, **CAMPAIGN
    )
    assert not result.quiet_stop and result.examples == 15
    assert not contract_identities(result), result.failures
    assert result.listed_seen and {f.identity for f in result.listed_seen} <= set(listed)


def test_an_example_goes_on_with_a_fresh_cache_after_a_listed_crash():
    """A listed failure that leaves the target diverged ends the op sequence on that cache,
    not the example: a ``new`` op follows another op only there."""
    listed = KnownFailures.load(shipped("mlx_vlm_0_7_10")).entries
    result = run_campaign(load_impl("mlx-vlm"), examples=15, seed=0, listed=listed, **CAMPAIGN)
    fresh = {pair: n for pair, n in result.pair_counts.items() if pair[1] == "new" and pair[0]}
    assert fresh, result.pair_counts


def test_spread_over_processes_it_stops_at_the_same_place_on_every_run():
    runs = [
        run_in_processes(
            MUTANT, processes=2, examples=200, seed=0, campaign=CAMPAIGN, quiet_rounds=2
        )
        for _ in range(2)
    ]
    assert runs[0].quiet_stop and runs[0].examples < 200
    assert "structure" in contract_identities(runs[0])
    assert campaign_summary(runs[0]) == campaign_summary(runs[1])
