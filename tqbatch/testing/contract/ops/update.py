"""``update``: ``update_and_fetch`` of a (B, H, T, D) block of keys and values."""

from __future__ import annotations

import mlx.core as mx
from hypothesis import strategies as st

from tqbatch.testing.contract import strategies as tqs
from tqbatch.testing.contract.ops.attend import attend_op
from tqbatch.testing.contract.ops.declaration import BadInput, Op, Rule, out_of_domain
from tqbatch.testing.oracles.generation import random_kv


def _shape(world, op, tokens):
    return (
        op.get("rows", world.numpy_model.batch_size),
        op.get("heads", world.kv_heads),
        tokens,
        op.get("head_dim", world.head_dim),
    )


def _validate(world, op):
    model = world.numpy_model
    if _shape(world, op, 0) != (model.batch_size, world.kv_heads, 0, world.head_dim):
        raise out_of_domain(op, "rows, heads and head_dim must be the batch's (the oracles' shape)")


def _target(world, op):
    shape = _shape(world, op, int(op["tokens"]))
    padded = (
        world.numpy_model.padding_slots(shape[2])
        if shape[0] == world.numpy_model.batch_size
        else None
    )
    keys, values = random_kv(op["kv_seed"], shape, op.get("scale", 1.0), padded)
    world.target.update_and_fetch(mx.array(keys), mx.array(values))
    return keys, values


def _oracles(world, op, ctx):
    world.write_oracles(*ctx)


def _append_block(machine, data):
    """A multi-token block: a plain update or a forward step with N > 1 queries."""
    if data.draw(st.booleans(), label="with attention"):
        return [data.draw(attend_op(machine.world.kv_heads), label="block")]
    # Now and then a long prompt: buffers grow in 256-slot steps, and bugs of
    # the physical end show only past the first step.
    long = data.draw(st.integers(0, 39), label="long") == 27
    tokens = data.draw(st.integers(200, 300) if long else st.integers(2, 4), label="tokens")
    return [{"op": "update", "tokens": tokens, "kv_seed": data.draw(tqs.seeds, label="kv_seed")}]


OP = Op(
    name="update",
    fields="`tokens: int`, `kv_seed: int`",
    meaning="`update_and_fetch` of `(B, H, tokens, D)` keys/values",
    target=_target,
    oracles=_oracles,
    validate=_validate,
    optional=(
        (
            "`scale: float`",
            "K/V scale (tokens at a scale other than 1 are exempt from the full-precision bound)",
        ),
        ("`rows`, `heads`, `head_dim: int`", "override the K/V shape (bad input)"),
    ),
    bad_inputs=(
        BadInput(
            "update-rows",
            "ValueError",
            lambda b: {"op": "update", "tokens": 1, "kv_seed": 0, "rows": b.rows + 1},
        ),
        BadInput(
            "update-head-dim",
            "ValueError",
            lambda b: {"op": "update", "tokens": 1, "kv_seed": 0, "head_dim": 16},
            after_write=True,
        ),
        BadInput(
            "update-heads",
            "ValueError",
            lambda b: {"op": "update", "tokens": 1, "kv_seed": 0, "heads": 3},
            after_write=True,
        ),
    ),
    rules=(Rule("append_block", _append_block, doc=_append_block.__doc__),),
)
