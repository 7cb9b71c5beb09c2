"""``trim``: drop the last ``n`` written slots of every row (uniform speculative rollback)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tqbatch.testing.contract import strategies as tqs
from tqbatch.testing.contract.checks import CONTRACT, Check
from tqbatch.testing.contract.ops.declaration import BadInput, Op, Recorded, Rule, out_of_domain
from tqbatch.testing.oracles.tolerances import EXACT


def _validate(world, op):
    if int(op["n"]) < 0:
        raise out_of_domain(op, "n must be >= 0")


def _target(world, op):
    return world.target.trim(int(op["n"]))


def _oracles(world, op, trimmed):
    dense_n = world.dense.trim(int(op["n"]))
    model_n, dropped = world.numpy_model.trim(int(op["n"]))
    if not isinstance(trimmed, (int, np.integer)) or int(trimmed) != model_n:
        world.report(
            "trim_count",
            op,
            f"trim returned {trimmed!r}, expected {model_n} (BatchKVCache: {dense_n})",
        )
    world.trim_references(dropped)
    return model_n


def _observe(target, op, result):
    return {"trimmed": np.array([int(result)], dtype=np.int64)}


def _speculative_rollback(machine, data):
    """Write a verify block, then trim part or all of it (at any B)."""
    block = data.draw(st.integers(1, 4), label="block")
    n = data.draw(st.integers(0, block), label="n")
    return [
        {"op": "update", "tokens": block, "kv_seed": data.draw(tqs.seeds, label="kv_seed")},
        {"op": "trim", "n": n},
    ]


def _trim(machine, data):
    n = data.draw(st.integers(0, min(machine.numpy_model.offsets)), label="n")
    return [{"op": "trim", "n": n}]


OP = Op(
    name="trim",
    fields="`n: int`",
    meaning="`target.trim(n)`",
    target=_target,
    oracles=_oracles,
    validate=_validate,
    needs=("trim",),
    checks=(Check("trim_count", CONTRACT, False, "trim(n) returns the number of tokens trimmed"),),
    observe=_observe,
    recorded=(
        Recorded("trimmed", ("trimmed",), {**EXACT, "reason": "integer returned by trim()"}),
    ),
    bad_inputs=(BadInput("trim-negative", "ValueError", lambda b: {"op": "trim", "n": -1}),),
    rules=(
        Rule(
            "speculative_rollback",
            _speculative_rollback,
            lambda machine: machine.has("trim"),
            doc=_speculative_rollback.__doc__,
        ),
        Rule(
            "trim",
            _trim,
            lambda machine: machine.has("trim") and min(machine.numpy_model.offsets) > 0,
        ),
    ),
    notes=(
        "`trim`: the harness only generates `n` up to the shortest row's offset (BatchKVCache "
        "lets a trim eat into left padding, which leaves a row with a negative offset: "
        "replayable, but not a state a server produces).",
    ),
)
