"""``roundtrip``: ``state``/``meta_state`` into a fresh instance, which replaces the target."""

from __future__ import annotations

import inspect

import numpy as np

from tqbatch.testing.contract.checks import POLICY, Check
from tqbatch.testing.contract.ops.declaration import Op, Rule


def from_state(cls, state, meta_state):
    """A fresh instance from ``state``/``meta_state``, as a prompt-cache loader builds it."""
    build = getattr(cls, "from_state", None)
    if build is not None:
        try:
            params = inspect.signature(build).parameters
        except (TypeError, ValueError):
            params = {}
        if len(params) >= 2:
            return build(state, meta_state)
    obj = cls.__new__(cls)  # mlx-lm's protocol: no __init__, then the setters
    obj.state = state
    obj.meta_state = meta_state
    return obj


def _target(world, op):
    donor = world.target
    state, meta = donor.state, donor.meta_state
    fresh = from_state(world.impl, state, meta)
    # A restored copy must share no array with its donor: write poison into
    # the donor; the checks after the op then compare the fresh copy with the
    # oracles. Trimmed by one first where it can be, so that the first poison
    # token lands in a slot the copy holds (past the end it would be
    # invisible), then a second one, so that an offset shared with the copy
    # moves too. One token per write: the first must fit the buffer the copy
    # may share (a longer write would grow the donor into new arrays).
    if not donor.empty():
        pending = world.numpy_model.right_padding is not None  # trim waits for finalize
        if world.capabilities["trim"] and min(world.numpy_model.offsets) >= 1 and not pending:
            donor.trim(1)
        rng = np.random.default_rng(12345)
        for _ in range(2):
            poison = world.poison_row_token(world.numpy_model.batch_size, rng)
            donor.update_and_fetch(poison, poison)
    return fresh


def _oracles(world, op, fresh):
    world.target = fresh
    pending = world.numpy_model.right_padding
    if pending is not None and getattr(fresh, "_right_padding", pending) is None:
        # Read where mlx-lm keeps it: a restore without it has dropped the
        # padding still pending, as BatchKVCache's state does (it is not in
        # its state). A legal choice mid-prefill (tqbatch keeps it): the
        # oracles follow, the tail is tokens and finalize rolls nothing.
        world.report(
            "roundtrip_pending",
            op,
            f"the restored cache dropped the right padding still pending {pending} "
            "(tqbatch keeps it)",
        )
        world.numpy_model.right_padding = None
        world.dense.cache._right_padding = None


OP = Op(
    name="roundtrip",
    fields="—",
    meaning="`state`/`meta_state` into a fresh instance, which replaces the target",
    target=_target,
    oracles=_oracles,
    needs=("roundtrip",),
    checks=(
        Check(
            "roundtrip_pending",
            POLICY,
            False,
            "a state round trip keeps right padding still pending (BatchKVCache's drops it)",
        ),
    ),
    rules=(
        # Back-to-back round trips test nothing new and, taking no draws, would
        # otherwise crowd out the rules that do.
        Rule(
            "roundtrip",
            lambda machine, data: [{"op": "roundtrip"}],
            lambda machine: machine.has("roundtrip") and machine.previous_op != "roundtrip",
            draws=False,
        ),
    ),
    notes=(
        "`extract` also appends one poison token to the extracted cache, and `roundtrip` trims "
        "the donor by one token (where the target can trim and every row has one) and appends "
        "two poison tokens to it one at a time, the first into a slot the copy holds: a copy "
        "sharing arrays (or an offset array) with its source would then move, which the checks "
        "catch.",
    ),
)
