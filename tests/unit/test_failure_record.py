"""One failure record from the check that raised it to the JSON a run saves."""

from __future__ import annotations

import json

import pytest

from tqbatch.testing.contract.checks import CheckFailure, ToleratedDivergence
from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.mutants import MUTANTS
from tqbatch.testing.search.campaign import CampaignResult, run_campaign
from tqbatch.testing.world import World


def _check_failure() -> CheckFailure:
    """A real check's failure: a mutant whose ``size()`` is an array, caught on ``new``."""
    world = World(MUTANTS["SizeAsArray"], head_dim=32)
    try:
        world.apply({"op": "new", "left_padding": [0]})
        world.check()
    except (CheckFailure, ToleratedDivergence) as exc:
        return exc if isinstance(exc, CheckFailure) else exc.failure
    pytest.fail("SizeAsArray passed its checks")


def test_a_check_failure_keeps_its_identity_level_and_what():
    exc = _check_failure()
    failure = Failure.of(exc, impl="m:C", ops=[{"op": "new"}])
    assert (failure.identity, failure.check, failure.level) == (
        exc.identity,
        "size_type",
        "contract",
    )
    assert failure.what == exc.what and failure.message == str(exc)
    assert failure.key == exc.identity and failure.summary == exc.what.splitlines()[0]
    assert failure.line().startswith(f"{exc.identity} [contract, 1 ops]: ")


def test_anything_else_is_a_failure_of_the_harness_told_apart_by_its_message():
    failure = Failure.of(KeyError("no such op"), ops=[])
    assert (failure.identity, failure.level) == ("", "harness")
    assert failure.key == failure.message == "KeyError: 'no such op'"
    assert failure.line() == "(no identity) [harness, 0 ops]: KeyError: 'no such op'"


def test_a_failure_without_ops_says_none_and_a_repro_goes_under_it():
    failure = Failure(level="contract", what="llama / decode: FAIL\nmore", repro="tqbatch replay x")
    assert (
        failure.line()
        == "(no identity) [contract]: llama / decode: FAIL\n    reproduce: tqbatch replay x"
    )


def test_a_campaign_result_round_trips_through_json_with_its_records():
    # What a survey process writes and its parent reads (shards), and what a
    # saved campaign holds: the records come back as records, every field kept.
    result = run_campaign(MUTANTS["SizeAsArray"], examples=3, profile="ci", seed=0, survey=True)
    result.listed_seen.append(Failure(identity="size", level="contract", what="listed"))
    assert result.failures and all(isinstance(f, Failure) for f in result.failures)
    back = CampaignResult.from_json(json.loads(json.dumps(result.to_json())))
    assert back.failures == result.failures and back.listed_seen == result.listed_seen
    assert back.outcome() == result.outcome()


def test_a_record_with_a_field_it_does_not_know_is_refused():
    data = Failure(identity="size").to_json() | {"severity": "high"}
    with pytest.raises(ValueError, match="severity"):
        Failure.from_json(data)
