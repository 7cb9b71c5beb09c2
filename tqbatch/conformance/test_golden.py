"""Each golden scenario shipped with tqbatch, against the cache under test (tqbatch.conformance)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.gate.session import FOUND, conclude, repro
from tqbatch.testing.replay import golden

SCENARIOS = golden.paths()


def _identity(divergence) -> tuple[str, str]:
    """The identity and level of a replay's divergence: its check's, where it is one."""
    from tqbatch.testing.contract.checks import CONTRACT, identity, where_of
    from tqbatch.testing.contract.ops import CHECKS

    check = CHECKS.get(divergence.quantity)
    if check is None:  # a recording that differs, or a target that cannot be read
        return "", CONTRACT
    return identity(check.name, where_of(divergence.op) if check.per_op else None), check.level


@pytest.mark.parametrize("scenario_path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_golden(scenario_path: Path, tqbatch_harness, request):
    """A golden scenario replays green against the cache."""
    from tqbatch.testing.replay.replayer import replay
    from tqbatch.testing.replay.scenario import Scenario

    state = tqbatch_harness
    use_recording = not state.oracles_only
    scenario = Scenario.load(scenario_path)
    if state.listed:
        # Run past listed failures where the cache has not diverged, as a
        # replay of a survey's find runs past what it tolerated.
        scenario.found_on = {"tolerated": sorted(state.listed)}
    result = replay(scenario, state.impl, use_recording=use_recording)
    # Which construction built the batches (merge, or the constructor where the
    # cache has no merge) is in the skip and failure text: a failure at the
    # first op of one differs in kind from one of the other.
    built = f" [{result.built}]" if result.built else ""
    if result.skipped:
        pytest.skip(result.skipped + built)
    if result.ok:
        # Listed failures it ran past are still failures found: the known-failures
        # summary counts them as still failing, not as unchecked.
        for identity in result.tolerated:
            request.node.user_properties.append((FOUND, identity))
        return
    first = result.divergences[0]
    identity, level = _identity(first)
    if state.listed and not identity:
        # A divergence that is no check's (the target could not be read as
        # recorded, a recorded value differs) may only follow from a listed
        # failure run past: without running past them, which fails first?
        scenario.found_on = None
        plain = replay(scenario, state.impl, use_recording=use_recording)
        cause = _identity(plain.divergences[0]) if plain.divergences else ("", "")
        if cause[0] in state.listed and plain.divergences[0].step <= first.step:
            first, (identity, level) = plain.divergences[0], cause
    what = f"{first}{built}"
    found = Failure(
        identity=identity,
        level=level,
        what=what,
        ops=list(scenario.ops),
        repro=repro(state, scenario_path),
    )
    conclude(request, state, [found], note=built)
