"""A campaign runs Hypothesis's simplest example once, not once per round.

Each round is a Hypothesis run, and the engine starts every run with the
example whose every choice is the simplest: the same whatever the seed.
"""

from __future__ import annotations

import json

from tqbatch import BatchTurboQuantKVCache
from tqbatch.testing import world
from tqbatch.testing.search import campaign, hypothesis_internals, stateful


def _examples(monkeypatch, rounds: int) -> list[str]:
    """Each example's op sequence, in the order run, over a campaign of ``rounds`` rounds."""
    examples: list[list[str]] = []
    make_world, apply = stateful.BatchCacheMachine._make_world, world.World.apply

    def new_example(self):
        if not self.left_behind:
            examples.append([])
        return make_world(self)

    def recorded(self, op):
        if examples:
            examples[-1].append(json.dumps(op))
        return apply(self, op)

    monkeypatch.setattr(stateful.BatchCacheMachine, "_make_world", new_example)
    monkeypatch.setattr(world.World, "apply", recorded)
    result = campaign.run_campaign(
        BatchTurboQuantKVCache, examples=rounds * campaign.ROUND_EXAMPLES, profile="ci", seed=2
    )
    assert result.rounds == rounds and result.examples == rounds * campaign.ROUND_EXAMPLES
    return ["\n".join(ops) for ops in examples]


def test_the_simplest_example_runs_in_the_first_round_only(monkeypatch):
    examples = _examples(monkeypatch, rounds=3)
    simplest = examples[0]  # the engine runs it first
    assert examples.count(simplest) == 1


def test_without_the_skip_every_round_runs_it_again(monkeypatch):
    run_machine = hypothesis_internals.run_machine
    monkeypatch.setattr(
        hypothesis_internals,
        "run_machine",
        lambda machine, settings, key, simplest=True: run_machine(machine, settings, key),
    )
    examples = _examples(monkeypatch, rounds=3)
    assert examples.count(examples[0]) == 3
