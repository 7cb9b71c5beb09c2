"""Survey mode: every distinct failing check, each with a repro that shows that one.

Against purpose-built caches with known bugs (budgets fixed, seeds fixed:
the same examples on every run), the survey must list each bug under its
check, save a scenario per bug whose replay fails on that check, keep a
different error policy apart from the contract, and find nothing in tqbatch.
"""

from __future__ import annotations

import pytest

import tqbatch
from tqbatch.testing.campaign import CampaignResult, conforms, run_campaign, survey_test_case
from tqbatch.testing.mutants import ExtractDropsLastToken, FilterWithoutCompaction
from tqbatch.testing.scenario import replay, write_failure


class FilterAndExtractBugs(FilterWithoutCompaction, ExtractDropsLastToken):
    """Two bugs at once: filter keeps shared padding; extract loses the newest token."""


class TypeErrorPolicy(tqbatch.BatchTurboQuantKVCache):
    """Correct, but rejects a repeated filter index with TypeError (tqbatch: ValueError)."""

    def filter(self, batch_indices):
        indices = list(batch_indices)
        if len(set(indices)) != len(indices):
            raise TypeError("repeated row index")
        return super().filter(indices)


def _survey(impl, examples=40):
    return run_campaign(impl, examples=examples, profile="ci", seed=0, survey=True)


@pytest.fixture(scope="module")
def two_bugs():
    return _survey(FilterAndExtractBugs)


def test_survey_lists_both_bugs_under_their_checks(two_bugs):
    checks = {f["check"] for f in two_bugs.failures}
    assert {"left_padding", "extract_length"} <= checks, [f["identity"] for f in two_bugs.failures]
    assert not conforms(two_bugs)
    identities = [f["identity"] for f in two_bugs.failures]
    assert len(identities) == len(set(identities))
    # Honest counts: examples are generated ones, shrinking is counted apart.
    assert two_bugs.examples >= 40 and two_bugs.shrink_runs > 0


def test_each_saved_failure_replays_its_own_check(two_bugs, tmp_path):
    for failure in two_bugs.failures:
        path = write_failure(
            failure["ops"],
            failure["config"],
            tmp_path,
            error=failure["message"],
            options={"impl": "test:FilterAndExtractBugs"},
            identity=failure["identity"],
            tolerated=failure["tolerated"],
        )
        result = replay(path, FilterAndExtractBugs, use_recording=False)
        assert result.divergences, failure["identity"]
        assert result.divergences[0].quantity == failure["check"], result.summary()
        assert replay(path, use_recording=False).ok  # the correct cache passes the same ops


def test_another_error_policy_is_reported_as_policy():
    result = _survey(TypeErrorPolicy, examples=60)
    assert [f["identity"] for f in result.failures] == ["error_type@filter-repeated"]
    assert result.failures[0]["level"] == "policy"
    assert conforms(result)


def test_tqbatch_survey_is_clean():
    result = _survey(tqbatch.BatchTurboQuantKVCache, examples=15)
    assert result.failures == [] and conforms(result)


def test_a_plain_campaign_stops_at_the_first_failure():
    result = run_campaign(FilterAndExtractBugs, examples=40, profile="ci", seed=0)
    assert len(result.failures) == 1


def test_shards_keep_every_failure_and_the_shortest_repro():
    def shard(*failures):
        return CampaignResult(
            examples=3,
            failures=[{"identity": i, "ops": [{}] * n, "message": i} for i, n in failures],
        )

    total = CampaignResult()
    total.absorb(shard(("a@filter", 5), ("b", 2)))
    total.absorb(shard(("a@filter", 3), ("c@trim", 4)))
    assert [(f["identity"], len(f["ops"])) for f in total.failures] == [
        ("a@filter", 3),
        ("b", 2),
        ("c@trim", 4),
    ]
    assert total.examples == 6


def test_survey_test_case_lists_every_failure():
    case = survey_test_case(FilterAndExtractBugs, examples=15)("runTest")
    with pytest.raises(AssertionError) as info:
        case.runTest()
    assert "left_padding@filter" in str(info.value) and "distinct failures" in str(info.value)
