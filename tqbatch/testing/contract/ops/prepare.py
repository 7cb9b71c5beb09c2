"""``prepare``: announce left padding (before a prefill) or right padding (of the next write)."""

from __future__ import annotations

from hypothesis import strategies as st

from tqbatch.testing.contract import strategies as tqs
from tqbatch.testing.contract.ops.batches import other_batch_ops
from tqbatch.testing.contract.ops.declaration import (
    BadInput,
    Op,
    Rule,
    out_of_domain,
    require_row_counts,
)
from tqbatch.testing.contract.ops.filter import filter_indices


def _validate(world, op):
    for name in ("left_padding", "right_padding"):
        if op.get(name) is not None:
            require_row_counts(op, name, world.numpy_model.batch_size)
    if op.get("left_padding") is not None and world.numpy_model.end > 0:
        raise out_of_domain(op, "left padding is announced before the prefill, not after a write")


def _target(world, op):
    kwargs = {k: op.get(k) for k in ("left_padding", "right_padding") if op.get(k) is not None}
    world.target.prepare(**kwargs)


def _oracles(world, op, _):
    world.numpy_model.prepare(op.get("left_padding"), op.get("right_padding"))
    world.dense.prepare(op.get("left_padding"), op.get("right_padding"))


# What happens between a right-padded prefill and finalize (``_right_padded_append``).
# Built once: Hypothesis analyses every new strategy object.
_WHILE_PENDING = st.sampled_from(["none", "filter", "extract", "roundtrip", "extend"])


def _right_padded_append(machine, data):
    """prepare(right_padding) + block + finalize on the current batch."""
    ops = data.draw(tqs.right_padded_prefill_ops(rows=machine.numpy_model.batch_size), label="ops")
    B = machine.numpy_model.batch_size
    # Between the prefill and finalize, while right padding is pending: a
    # request finishes, one is read out, the cache is saved and restored, or
    # another batch joins. (A trim there is not a state servers make.)
    what = data.draw(_WHILE_PENDING, label="while pending")
    if what == "filter" and machine.has("filter") and B > 1:
        keep = data.draw(filter_indices(machine.numpy_model.left_padding), label="keep")
        ops.insert(-1, {"op": "filter", "indices": keep})
    elif what == "extract" and machine.has("extract"):
        index = data.draw(st.integers(0, B - 1), label="index")
        ops.insert(-1, {"op": "extract", "index": index})
    elif what == "roundtrip" and machine.has("roundtrip"):
        ops.insert(-1, {"op": "roundtrip"})
    elif what == "extend" and machine.has("extend") and B < tqs.MAX_ROWS:
        room = min(2, tqs.MAX_ROWS - B)
        other = data.draw(other_batch_ops(machine.caps, max_rows=room), label="other")
        ops.insert(-1, {"op": "extend", "other": other})
    return ops


OP = Op(
    name="prepare",
    fields="`left_padding: [int] \\| null`, `right_padding: [int] \\| null`",
    meaning="`target.prepare(...)`",
    target=_target,
    oracles=_oracles,
    validate=_validate,
    needs=("prepare",),
    bad_inputs=(
        BadInput(
            "prepare-negative-right",
            "ValueError",
            lambda b: {"op": "prepare", "left_padding": None, "right_padding": [-1] * b.rows},
        ),
        BadInput(
            "prepare-left-length",
            "ValueError",
            lambda b: {"op": "prepare", "left_padding": [0] * (b.rows + 1), "right_padding": None},
        ),
        BadInput(
            "prepare-left-after-write",
            "ValueError",
            lambda b: {"op": "prepare", "left_padding": [1] * b.rows, "right_padding": None},
            after_write=True,
        ),
        # a valid right padding with the refused left one: nothing may stick
        BadInput(
            "prepare-both-after-write",
            "ValueError",
            lambda b: {
                "op": "prepare",
                "left_padding": [1] * b.rows,
                "right_padding": [1] * b.rows,
            },
            after_write=True,
        ),
    ),
    rules=(
        Rule(
            "right_padded_append",
            _right_padded_append,
            lambda machine: machine.has("prepare") and machine.has("finalize"),
            doc="prepare(right_padding) + block + finalize on the current batch.",
        ),
    ),
)
