"""The survey spread over processes (``tqbatch.testing.search.shards.run_in_processes``)."""

from __future__ import annotations

import pytest

import tqbatch
from tqbatch.conformance.test_state_machine import _importable_spec
from tqbatch.testing.search.shards import run_in_processes

from .support import campaign_summary

MUTANT = "tqbatch.testing.mutants:HasIdxAttribute"  # found in the first examples
CAMPAIGN = dict(profile="ci", survey=True)


def test_the_same_examples_on_every_run():
    """Each process draws under its own seed: two runs give the same examples, op counts and
    failures. (Not equal to the same seeds run in the test process: Hypothesis draws
    constants from the modules a process has imported.)"""
    runs = [
        run_in_processes(MUTANT, processes=2, examples=5, seed=3, campaign=CAMPAIGN)
        for _ in range(2)
    ]
    assert runs[0].failures, "the mutant's failure was not found"
    assert campaign_summary(runs[0]) == campaign_summary(runs[1])
    assert sorted(s["shard"] for s in runs[0].shards) == [0, 1]
    assert sorted(s["examples"] for s in runs[0].shards) == [2, 3]


def test_progress_is_reported_while_running():
    seen = []
    run_in_processes(
        "tqbatch:BatchTurboQuantKVCache",
        processes=2,
        examples=4,
        seed=0,
        campaign=CAMPAIGN,
        on_update=lambda result: seen.append(result.examples),
    )
    assert seen and seen == sorted(seen)


def test_a_process_that_fails_is_reported_with_its_output():
    with pytest.raises(RuntimeError, match=r"(?s)survey processes failed.*no_such_module"):
        run_in_processes("no_such_module:Cache", processes=2, examples=2, seed=0, campaign=CAMPAIGN)


def test_more_processes_than_examples_start_only_those_with_a_share():
    result = run_in_processes(
        "tqbatch:BatchTurboQuantKVCache", processes=3, examples=1, seed=0, campaign=CAMPAIGN
    )
    assert result.examples == 1 and [s["shard"] for s in result.shards] == [0]


def test_processes_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        run_in_processes("tqbatch:BatchTurboQuantKVCache", processes=0, examples=1, seed=0,
                         campaign=CAMPAIGN)  # fmt: skip


def test_a_class_no_import_reaches_runs_in_the_test_process():
    class Local(tqbatch.BatchTurboQuantKVCache):
        pass

    assert _importable_spec(Local) is None
    assert _importable_spec(tqbatch.BatchTurboQuantKVCache) is not None
