"""``new``: an empty batch, ``Impl(left_padding, bits, seed)``."""

from __future__ import annotations

from tqbatch.testing.contract.ops.declaration import Op
from tqbatch.testing.oracles.reference import DenseReference


def _target(world, op):
    return world.construct(op["left_padding"], op.get("bits"), op.get("seed"))


def _oracles(world, op, target):
    world.target = target
    world.numpy_model.reset_empty(op["left_padding"])
    world.dense = DenseReference.empty(op["left_padding"])
    for row in world.numpy_model.rows:
        world.refs.new(row.request.id)


OP = Op(
    name="new",
    fields="`left_padding: [int]`",
    meaning="replace the target with an empty `Impl(left_padding, bits, seed)`",
    target=_target,
    oracles=_oracles,
    needs_of=lambda world, op: world.configuration_needs(op.get("seed")),
    optional=(
        (
            "`bits: float`, `seed: int`",
            "configuration of this batch instead of the world's (bad input in `extend`)",
        ),
    ),
)
