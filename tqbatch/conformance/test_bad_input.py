"""Each case of the bad-input catalogue, against the cache under test (``tqbatch.conformance``)."""

from __future__ import annotations

import pytest

from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.contract.ops import BAD_INPUT_ERRORS
from tqbatch.testing.gate.session import BY_CASE, conclude, failing, options, repro, spec

# The cases in the catalogue's order: test ids that do not depend on the target.
CASES = list(BAD_INPUT_ERRORS)
# The batch each case is tried on: three rows, one of them empty, left
# padding, tokens written and attended to.
BATCH_LENGTHS = [3, 0, 5]
Q_HEADS = 4


def _setup_ops(capabilities: dict) -> list[dict]:
    if capabilities.get("merge"):
        ops = [{"op": "merge", "lengths": BATCH_LENGTHS, "kv_seed": 1}]
    else:
        longest = max(BATCH_LENGTHS)
        ops = [
            {"op": "new", "left_padding": [longest - n for n in BATCH_LENGTHS]},
            {"op": "update", "tokens": longest, "kv_seed": 1},
        ]
    return ops + [{"op": "attend", "queries": 1, "q_heads": Q_HEADS, "q_seed": 2}]


@pytest.mark.tqbatch_expects(BY_CASE)
@pytest.mark.parametrize("case", CASES)
def test_bad_input(case, tqbatch_harness, request):
    """Bad input ``case`` is rejected with its documented error and changes nothing."""
    from tqbatch.testing.contract.checks import CheckFailure, ToleratedDivergence
    from tqbatch.testing.contract.ops import bad_input_cases, expect_error_op
    from tqbatch.testing.target import capabilities
    from tqbatch.testing.world import World

    state = tqbatch_harness
    listed = state.listed
    # Listed failures are run past (where the cache has not diverged), so that
    # a new one behind them is still found.
    world = World(state.impl, tolerate=(lambda f: f.identity in listed) if listed else None)
    caps = capabilities(state.impl)
    raised: list = []
    cases: dict = {}
    try:
        for op in _setup_ops(caps):
            world.apply(op)
            world.check()
        cases = dict(
            bad_input_cases(world.numpy_model.batch_size, world.numpy_model.end, caps, world.seed)
        )
        if case in cases:
            for op in (
                expect_error_op(case, cases[case]),
                # Still in lockstep with the oracles afterwards.
                {"op": "attend", "queries": 1, "q_heads": Q_HEADS, "q_seed": 3},
            ):
                world.apply(op)
                world.check()
    except CheckFailure as exc:
        raised = [exc, *exc.also]
    except ToleratedDivergence as exc:  # a listed failure after which the cache has diverged
        raised = [exc.failure]
    failures = list({f.identity: f for f in [*world.tolerated, *raised]}.values())
    if not failures and case not in cases:
        missing = sorted(name for name, ok in caps.items() if not ok)
        pytest.skip(f"{spec(state)} lacks what {case} needs (it lacks {', '.join(missing)})")
    found = [Failure.of(f, ops=list(world.ops)) for f in failures]
    if raised and failing(state, found):
        from tqbatch.testing.replay.scenario import write_failure

        path = write_failure(
            world.ops,
            world,
            state.failures_dir,
            error=str(raised[0]),
            options=options(request, state, case=case),
            identity=raised[0].identity,
            tolerated=sorted({f.identity for f in world.tolerated}),
        )
        for f in found:
            if f.identity in {r.identity for r in raised}:
                f.repro = repro(state, path)
    conclude(request, state, found)
