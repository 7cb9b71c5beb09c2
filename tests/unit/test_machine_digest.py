"""Campaigns have Hypothesis digest their machine class once per definition, not once per round
(``tqbatch.testing.search.hypothesis_internals.run_machine``)."""

from __future__ import annotations

import hypothesis.stateful

from tqbatch import BatchTurboQuantKVCache
from tqbatch.testing.search import campaign, hypothesis_internals
from tqbatch.testing.search.machine_observer import MachineObserver


def test_the_machine_class_is_digested_once_and_the_digest_function_restored(monkeypatch):
    original = hypothesis.stateful.function_digest
    digested = []

    def counting(function):
        digested.append(function)
        return original(function)

    monkeypatch.setattr(hypothesis.stateful, "function_digest", counting)
    monkeypatch.setattr(hypothesis_internals, "_DIGESTS", {})  # as in a fresh process
    for _ in range(2):
        result = campaign.run_campaign(
            BatchTurboQuantKVCache, examples=2 * campaign.ROUND_EXAMPLES, profile="ci"
        )
        assert result.rounds == 2
    # Two campaigns, each its own class of one definition, two rounds each: one digest.
    assert len(digested) == 1
    assert hypothesis.stateful.function_digest is counting


def test_the_digest_is_the_one_hypothesis_computes():
    from tqbatch.testing.search.hypothesis_internals import _digest_once
    from tqbatch.testing.search.stateful import machine_for

    original = hypothesis.stateful.function_digest
    machine = machine_for(BatchTurboQuantKVCache, observer=MachineObserver())
    want = original(machine)
    with _digest_once(machine):
        assert hypothesis.stateful.function_digest(machine) == want
        assert hypothesis.stateful.function_digest(machine) == want  # the one kept
        assert hypothesis.stateful.function_digest(len) == original(len)  # others as before
    assert hypothesis.stateful.function_digest is original
