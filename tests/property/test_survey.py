"""Survey mode: every distinct failing check, each with a repro that shows that one.

Against purpose-built caches with known bugs (budgets fixed, seeds fixed:
the same examples on every run), the survey must list each bug under its
check (two bugs of one op included), save a scenario per bug whose replay
fails on that check, keep a different error policy apart from the contract,
pass a cache that treats pending right padding as BatchKVCache does, and find
nothing in tqbatch.
"""

from __future__ import annotations

import pytest

import tqbatch
from tqbatch import _packed
from tqbatch.testing.contract.checks import CheckFailure, ToleratedDivergence
from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.mutants import (
    ExtractDropsLastToken,
    FilterWithoutCompaction,
    RoundtripAliasesDonor,
)
from tqbatch.testing.replay.replayer import replay
from tqbatch.testing.replay.scenario import write_failure
from tqbatch.testing.search.campaign import CampaignResult, conforms, run_campaign, survey_test_case
from tqbatch.testing.selfcheck.doubles import PendingPaddingAsBatchKVCache
from tqbatch.testing.world import World


class FilterAndExtractBugs(FilterWithoutCompaction, ExtractDropsLastToken):
    """Two bugs at once: filter keeps shared padding; extract loses the newest token."""


class TypeErrorPolicy(tqbatch.BatchTurboQuantKVCache):
    """Correct, but rejects a repeated filter index with TypeError (tqbatch: ValueError)."""

    def filter(self, batch_indices):
        indices = list(batch_indices)
        if len(set(indices)) != len(indices):
            raise TypeError("repeated row index")
        return super().filter(indices)


class RoundtripFastPathBugs(RoundtripAliasesDonor):
    """Two bugs of one op, always together: where every row holds a token, ``state`` cuts the
    buffers to the written end and hands them out (a restored copy shares them: the donor's
    next write lands in it) and counts each row's first token as padding (the restored offsets
    are one short)."""

    @property
    def state(self):
        if self.keys is not None and min(self.offset.tolist()) > 0:
            self.keys = _packed.token_range(self.keys, 0, self._end)
            self.values = _packed.token_range(self.values, 0, self._end)
            return self.keys, self.values, self.offset - 1, self.left_padding + 1
        return tqbatch.BatchTurboQuantKVCache.state.fget(self)

    @state.setter
    def state(self, value):
        RoundtripAliasesDonor.state.fset(self, value)


def _survey(impl, examples=40):
    return run_campaign(impl, examples=examples, profile="ci", seed=0, survey=True)


@pytest.fixture(scope="module")
def two_bugs():
    return _survey(FilterAndExtractBugs)


def test_survey_lists_both_bugs_under_their_checks(two_bugs):
    checks = {f.check for f in two_bugs.failures}
    assert {"left_padding", "extract_length"} <= checks, [f.identity for f in two_bugs.failures]
    assert not conforms(two_bugs)
    identities = [f.identity for f in two_bugs.failures]
    assert len(identities) == len(set(identities))
    # Honest counts: examples are generated ones, shrinking is counted apart.
    assert two_bugs.examples >= 40 and two_bugs.shrink_runs > 0


def test_each_saved_failure_replays_its_own_check(two_bugs, tmp_path):
    for failure in two_bugs.failures:
        path = write_failure(
            failure.ops,
            failure.config,
            tmp_path,
            error=failure.message,
            options={"impl": "test:FilterAndExtractBugs"},
            identity=failure.identity,
            tolerated=failure.tolerated,
        )
        result = replay(path, FilterAndExtractBugs, use_recording=False)
        assert result.divergences, failure.identity
        assert result.divergences[0].quantity == failure.check, result.summary()
        assert replay(path, use_recording=False).ok  # the correct cache passes the same ops


def test_another_error_policy_is_reported_as_policy():
    result = _survey(TypeErrorPolicy, examples=60)
    assert [f.identity for f in result.failures] == ["error_type@filter-repeated"]
    assert result.failures[0].level == "policy"
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
            failures=[Failure(identity=i, ops=[{}] * n, message=i) for i, n in failures],
        )

    total = CampaignResult()
    total.absorb(shard(("a@filter", 5), ("b", 2)))
    total.absorb(shard(("a@filter", 3), ("c@trim", 4)))
    assert [(f.identity, len(f.ops)) for f in total.failures] == [
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


def test_every_check_after_an_op_reports_its_failure():
    world = World(RoundtripFastPathBugs, bits=4.0, seed=0, kv_heads=2, head_dim=64)
    world.apply({"op": "merge", "lengths": [3, 5], "kv_seed": 1})
    world.check()
    with pytest.raises(CheckFailure) as info:
        world.apply({"op": "roundtrip"})
        world.check()
    identities = [info.value.identity] + [f.identity for f in info.value.also]
    assert identities[0] == "offset@roundtrip"
    # The aliasing is not hidden behind the offset (which has diverged).
    assert "content@roundtrip" in identities and "content@roundtrip" in info.value.__notes__[0]
    assert len(set(identities)) == len(identities)
    # Every one tolerated: the offset has diverged, so the run ends there.
    world = World(RoundtripFastPathBugs, tolerate=lambda f: True)
    world.apply({"op": "merge", "lengths": [3, 5], "kv_seed": 1})
    with pytest.raises(ToleratedDivergence):
        world.apply({"op": "roundtrip"})
        world.check()


def test_two_bugs_of_one_op_each_get_their_own_repro(tmp_path):
    # The aliasing shows only where the offset fails too, which ends the example
    # (it has diverged): it is found among the other checks of that op.
    result = _survey(RoundtripFastPathBugs, examples=5)
    by_identity = {f.identity: f for f in result.failures}
    assert {"offset@roundtrip", "content@roundtrip"} <= set(by_identity), list(by_identity)
    assert "offset@roundtrip" in by_identity["content@roundtrip"].tolerated
    for identity in ("offset@roundtrip", "content@roundtrip"):
        failure = by_identity[identity]
        path = write_failure(
            failure.ops,
            failure.config,
            tmp_path / identity.replace("@", "-"),
            error=failure.message,
            identity=identity,
            tolerated=failure.tolerated,
        )
        replayed = replay(path, RoundtripFastPathBugs, use_recording=False)
        assert replayed.divergences[0].quantity == failure.check, replayed.summary()


def test_pending_padding_as_batchkvcache_conforms_with_policy_differences():
    # Whether a short survey reaches an extract or a round trip while right
    # padding is pending depends on what Hypothesis draws (its pool of source
    # constants differs between processes), so this asserts only what holds
    # for any draw: no contract failure, and every difference one of the two
    # policies. test_checks.py drives both situations explicitly.
    result = _survey(PendingPaddingAsBatchKVCache, examples=20)
    assert conforms(result), [(f.identity, f.level) for f in result.failures]
    assert {f.identity for f in result.failures} <= {
        "extract_pending@extract",
        "roundtrip_pending@roundtrip",
    }
    assert all(f.level == "policy" for f in result.failures)
