"""Each machine of ``machine_for`` reports to its own observer; the classes keep no counts."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import tqbatch
from tqbatch.testing.mutants import SizeAsArray
from tqbatch.testing.search.machine_observer import MachineObserver
from tqbatch.testing.search.stateful import BatchCacheMachine, machine_for

FEW = settings(
    max_examples=2,
    stateful_step_count=3,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    print_blob=False,
)


def _mutable_class_attributes(cls: type) -> list[str]:
    return [
        name
        for name, value in vars(cls).items()
        if not name.startswith("__") and isinstance(value, (dict, list, set))
    ]


def test_two_machines_with_their_own_observers_share_no_counts_and_no_failures():
    clean_observer = MachineObserver()
    clean = machine_for(tqbatch.BatchTurboQuantKVCache, observer=clean_observer)
    buggy = machine_for(SizeAsArray)  # a fresh observer of its own
    assert clean.observer is clean_observer
    assert isinstance(buggy.observer, MachineObserver) and buggy.observer is not clean_observer

    run_state_machine_as_test(clean, settings=FEW)
    assert clean_observer.op_counts and clean_observer.pair_counts
    assert clean_observer.failures == {} and clean_observer.last_failure is None
    counts = clean_observer.counts()

    with pytest.raises(AssertionError):  # size() is an array: its first check fails
        run_state_machine_as_test(buggy, settings=FEW)
    failure = buggy.observer.last_failure
    assert failure is not None and failure.check == "size_type"
    assert buggy.observer.failures == {failure.identity: failure}
    assert buggy.observer.op_counts  # the ops before the failure
    # The clean machine's observer saw none of it.
    assert clean_observer.counts() == counts
    assert clean_observer.failures == {} and clean_observer.last_failure is None


def test_the_machine_classes_hold_no_mutable_counters():
    machine = machine_for(tqbatch.BatchTurboQuantKVCache)
    assert _mutable_class_attributes(BatchCacheMachine) == []
    assert _mutable_class_attributes(machine) == []
    assert BatchCacheMachine.observer is None  # only machine_for's classes report


def test_counts_since_a_snapshot_leave_out_what_did_not_run_again():
    observer = MachineObserver()
    observer.op_ran(None, "update")
    observer.op_ran("update", "attend")
    before = observer.counts()
    observer.op_ran(None, "update")
    observer.op_ran("update", "trim")
    assert observer.counts_since(before) == ({"update": 1, "trim": 1}, {("update", "trim"): 1})
    assert observer.op_counts == {"update": 2, "attend": 1, "trim": 1}
