"""``filter``: keep the rows at ``indices`` (finished requests leave the batch)."""

from __future__ import annotations

import functools

from hypothesis import strategies as st

from tqbatch.testing.contract.ops.declaration import BadInput, Op, Rule, out_of_domain


def filter_indices(left_padding: list[int]):
    """A non-empty subset of rows in any order; often keeps or drops the unpadded row."""
    return _filter_indices(tuple(left_padding))


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
@st.composite
def _filter_indices(draw, left_padding: tuple[int, ...]):
    B = len(left_padding)
    keep = draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=B, unique=True))
    zero_rows = [b for b, p in enumerate(left_padding) if p == 0]
    if zero_rows and B > 1 and draw(st.booleans()):
        # Drop every unpadded row: the compaction case (omlx #2172).
        rest = [b for b in keep if b not in zero_rows] or [
            b for b in range(B) if b not in zero_rows
        ][:1]
        keep = rest or keep
    return keep


def _validate(world, op):
    rows = world.numpy_model.batch_size
    indices = [int(i) for i in op["indices"]]
    if not indices or len(set(indices)) < len(indices) or not all(0 <= i < rows for i in indices):
        raise out_of_domain(op, f"indices must be one or more distinct rows of the {rows}")


def _target(world, op):
    world.target.filter(list(op["indices"]))


def _oracles(world, op, _):
    world.dense.filter(op["indices"])
    world.numpy_model.filter(op["indices"])


def _filter(machine, data):
    keep = data.draw(filter_indices(machine.numpy_model.left_padding), label="keep")
    return [{"op": "filter", "indices": keep}]


OP = Op(
    name="filter",
    fields="`indices: [int]`",
    meaning="`target.filter(indices)`",
    target=_target,
    oracles=_oracles,
    validate=_validate,
    needs=("filter",),
    bad_inputs=(
        BadInput(
            "filter-out-of-range", "IndexError", lambda b: {"op": "filter", "indices": [b.rows]}
        ),
        # An empty batch, a row forked into two: a cache could define a meaning
        # for these; rejecting them is tqbatch's policy.
        BadInput(
            "filter-repeated",
            "ValueError",
            lambda b: {"op": "filter", "indices": [0, 0]},
            policy=True,
        ),
        BadInput(
            "filter-empty", "ValueError", lambda b: {"op": "filter", "indices": []}, policy=True
        ),
    ),
    rules=(Rule("filter", _filter, lambda machine: machine.has("filter")),),
)
