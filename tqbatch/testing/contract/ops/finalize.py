"""``finalize``: pending right padding becomes left padding (mlx-lm rolls the rows right)."""

from __future__ import annotations

from tqbatch.testing.contract.ops.declaration import Op


def _target(world, op):
    world.target.finalize()


def _oracles(world, op, _):
    world.dense.finalize()
    world.trim_references(world.numpy_model.finalize())


OP = Op(
    name="finalize",
    fields="—",
    meaning="`target.finalize()`",
    target=_target,
    oracles=_oracles,
    needs=("finalize",),
)
