"""Campaigns sharing one example database, in this process: keys, replay first, replay only.

The same through ``tqbatch fuzz`` in separate processes against a real Redis
server is tests/e2e/test_shared_database.py.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    InMemoryExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

import tqbatch
from tqbatch.testing.mutants import SizeAsArray
from tqbatch.testing.search.campaign import CampaignResult, campaign_key, run_campaign

# Fails its first check, so a campaign finds and shrinks it in well under a second.
MUTANT = SizeAsArray
CLEAN = tqbatch.BatchTurboQuantKVCache


class TwoBugs(tqbatch.BatchTurboQuantKVCache):
    """size() is wrong two ways, by codec seed: an array at seed 0, one too many otherwise."""

    def size(self):
        if self.seed == 0:
            return mx.array(self.offset)
        return super().size() + 1


class RecordingDatabase(InMemoryExampleDatabase):
    """An in-memory database that remembers every key read from it."""

    def __init__(self):
        super().__init__()
        self.read: set[bytes] = set()

    def fetch(self, key):
        self.read.add(key)
        yield from super().fetch(key)


def _primary(keys) -> set[bytes]:
    # Hypothesis also reads KEY.secondary and KEY.pareto.
    return {k for k in keys if not k.endswith((b".secondary", b".pareto"))}


def test_the_key_names_the_target_and_what_decides_whether_an_example_fails():
    keys = {
        campaign_key(MUTANT),
        campaign_key(CLEAN),
        campaign_key(MUTANT, contract_checks=False),
        campaign_key(MUTANT, survey=True),
    }
    assert len(keys) == 4
    assert campaign_key(MUTANT) == campaign_key(SizeAsArray, contract_checks=True, survey=False)


def test_a_find_is_replayed_before_anything_is_generated():
    db = RecordingDatabase()
    # The ci profile is derandomized and database-free: the campaign overrides both.
    first = run_campaign(MUTANT, examples=5, profile="ci", seed=1, database=db)
    assert [f.identity for f in first.failures] == ["size_type"]
    assert first.replayed == 0 and not first.failures[0].replayed
    # Saved under the campaign's key exactly: no version of anything in it.
    assert _primary(db.read) == {mutant_key := campaign_key(MUTANT)}
    assert list(db.fetch(mutant_key)), "the failure was not saved"

    for replay_only in (False, True):
        again = run_campaign(
            MUTANT,
            examples=None if replay_only else 5,
            profile="ci",
            seed=2,
            database=db,
            replay_only=replay_only,
        )
        assert [f.identity for f in again.failures] == ["size_type"]
        assert again.failures[0].replayed, replay_only
        assert again.replayed >= 1 and again.examples == 0 and again.rounds == 1, again

    # Another target reads its own key: the mutant's find is not replayed.
    db.read.clear()
    clean = run_campaign(CLEAN, examples=1, profile="ci", seed=3, database=db)
    assert clean.failures == [] and clean.replayed == 0 and clean.examples == 1
    assert _primary(db.read) == {campaign_key(CLEAN)}
    assert list(db.fetch(mutant_key)), "another target's campaign deleted the find"


def test_every_saved_failure_is_replayed_not_only_the_first():
    # A database holding two finds of one target, as the union of two
    # machines' directories would: here a survey's, copied to the plain key.
    db = InMemoryExampleDatabase()
    survey = run_campaign(TwoBugs, examples=10, profile="ci", survey=True, database=db)
    assert sorted(f.identity for f in survey.failures) == ["size", "size_type"]
    db.data[campaign_key(TwoBugs)] = set(db.data[campaign_key(TwoBugs, survey=True)])

    # A plain campaign replays both (Hypothesis alone would stop at the first
    # that still fails, and this run would not save the other again).
    plain = run_campaign(TwoBugs, examples=5, profile="ci", seed=5, database=db)
    assert sorted(f.identity for f in plain.failures) == ["size", "size_type"]
    assert all(f.replayed for f in plain.failures) and plain.examples == 0


def test_a_read_only_find_that_still_fails_is_saved_again_locally(tmp_path):
    # As a nightly reads the last night's artifact (read-only) beside the
    # directory it uploads: the finds still failing are carried forward.
    artifact = DirectoryBasedExampleDatabase(tmp_path / "artifact")
    run_campaign(MUTANT, examples=5, profile="ci", database=artifact)
    local = DirectoryBasedExampleDatabase(tmp_path / "local")
    db = MultiplexedDatabase(local, ReadOnlyDatabase(artifact))
    result = run_campaign(MUTANT, profile="ci", seed=1, database=db, replay_only=True)
    assert [(f.identity, f.replayed) for f in result.failures] == [("size_type", True)]
    assert list(local.fetch(campaign_key(MUTANT)))


def test_replaying_an_empty_database_checks_nothing():
    result = run_campaign(CLEAN, profile="ci", database=InMemoryExampleDatabase(), replay_only=True)
    assert (result.replayed, result.examples, result.failures, result.rounds) == (0, 0, [], 1)


def test_replay_only_needs_a_database():
    with pytest.raises(ValueError, match="database"):
        run_campaign(CLEAN, replay_only=True)


def test_replays_add_up_over_shards_and_survive_json():
    total = CampaignResult(replayed=2)
    shard = CampaignResult(replayed=3, examples=4)
    total.absorb(CampaignResult.from_json(json.loads(json.dumps(shard.to_json()))))
    assert (total.replayed, total.examples) == (5, 4)
    assert CampaignResult.from_json({k: v for k, v in total.to_json().items()}).replayed == 5
