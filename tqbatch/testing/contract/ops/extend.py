"""``extend``: another batch joins (built from nested ops), rows appended below."""

from __future__ import annotations

from hypothesis import strategies as st
from mlx_lm.models.cache import BatchRotatingKVCache

from tqbatch.testing.contract import strategies as tqs
from tqbatch.testing.contract.ops.batches import other_batch_ops
from tqbatch.testing.contract.ops.declaration import BadInput, Op, Rule, out_of_domain


def _validate(world, op):
    if op.get("foreign"):
        raise out_of_domain(op, "a rotating window must be refused by any cache")


def _target(world, op):
    other = world.spawn()
    for inner in op["other"]:
        other.apply(inner)
    if op.get("foreign"):  # bad input: a rotating window is not a request's history
        world.target.extend(BatchRotatingKVCache(8, [0] * len(other.numpy_model.offsets)))
    elif op.get("as_dense"):  # the other batch in full precision: quantized on the way in
        if other.dense.right_padding is not None:
            raise ValueError("extend as_dense: finalize the other batch first")
        world.target.extend(other.dense.copy())
    else:
        world.target.extend(other.target)
    return other


def _oracles(world, op, other):
    world.dense.extend(other.dense)
    world.numpy_model.extend(other.numpy_model)
    world.refs.absorb(other.refs)


def _extend(machine, data):
    room = tqs.MAX_ROWS - machine.numpy_model.batch_size
    other = data.draw(other_batch_ops(machine.caps, max_rows=min(2, room)), label="other")
    op = {"op": "extend", "other": other}
    if data.draw(st.integers(0, 3), label="full precision") == 0:
        op["as_dense"] = True  # joiners handed over in mlx-lm's BatchKVCache
    return [op]


def _mixed_config(batch):
    if not batch.capabilities.get("seed", True):
        return None  # the other batch is built with another seed
    other = [
        {"op": "new", "left_padding": [0], "seed": batch.world_seed + 1},
        {"op": "update", "tokens": 2, "kv_seed": 1},
    ]
    return {"op": "extend", "other": other}


OP = Op(
    name="extend",
    fields="`other: [op]`",
    meaning="build a second batch from the nested ops (which start with `merge` or `new`), "
    "then `target.extend(other)`",
    target=_target,
    oracles=_oracles,
    validate=_validate,
    needs=("extend",),
    optional=(
        (
            "`as_dense: true`",
            "pass a copy of the other batch's full-precision mlx-lm `BatchKVCache` instead "
            "(quantized by the extend)",
        ),
        ("`foreign: true`", "pass an mlx-lm `BatchRotatingKVCache` instead (bad input)"),
    ),
    bad_inputs=(
        BadInput("extend-mixed-config", "ValueError", _mixed_config),
        BadInput(
            "extend-foreign",
            "TypeError",
            lambda b: {
                "op": "extend",
                "other": [{"op": "new", "left_padding": [0]}],
                "foreign": True,
            },
        ),
    ),
    rules=(
        Rule(
            "extend",
            _extend,
            lambda machine: machine.has("extend") and machine.numpy_model.batch_size < tqs.MAX_ROWS,
        ),
    ),
)
