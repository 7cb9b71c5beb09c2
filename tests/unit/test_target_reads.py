"""What the checks after an op read of the target: each quantity once, in the checks'
order, judged as it was returned, and a read that raises reported by its own check."""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest

import tqbatch
from tqbatch.testing.contract.checks import CheckFailure
from tqbatch.testing.contract.invariants import MASK_CHECKS
from tqbatch.testing.world import World

READS = ("offset", "left_padding", "size", "make_mask", "empty", "dequantize")
# The order the checks use them: geometry, each mask with return_array and
# without, then the rows' content.
ORDER = ["offset", "left_padding", "size", *["make_mask"] * 2 * len(MASK_CHECKS)]
ORDER += ["empty", "dequantize"]


class Recorded(tqbatch.BatchTurboQuantKVCache):
    """tqbatch's cache, logging each read the harness makes while ``log`` is a list (its
    own code's reads are not logged)."""

    log: list | None = None

    def __getattribute__(self, name):
        log = object.__getattribute__(self, "log")
        if log is not None and name in READS and _by_the_harness(sys._getframe(1)):
            object.__getattribute__(self, "_read")(name)
            log.append(name)
        return object.__getattribute__(self, name)

    def _read(self, name):
        """Called as the harness reads ``name`` (a read that raises raises here)."""


def _by_the_harness(frame) -> bool:
    return frame.f_globals.get("__name__", "").startswith("tqbatch.testing.")


def _world(impl) -> World:
    world = World(impl, head_dim=32)
    world.apply({"op": "new", "left_padding": [1, 0]})
    world.check()
    world.apply({"op": "update", "tokens": 3, "kv_seed": 5})
    return world


def _failure(world) -> CheckFailure:
    with pytest.raises(CheckFailure) as raised:
        world.check()
    return raised.value


def _identities(failure: CheckFailure) -> list[str]:
    return [f.identity for f in (failure, *failure.also)]


def test_the_checks_read_each_quantity_once_in_their_order():
    world = _world(Recorded)
    world.target.log = []
    world.check()
    assert world.target.log == ORDER


def test_the_checks_wait_for_mlx_once():
    world = _world(tqbatch.BatchTurboQuantKVCache)
    evaluations = []
    real_eval = mx.eval

    def counted(*args, **kwargs):
        evaluations.append(args)
        return real_eval(*args, **kwargs)

    # Later evaluations of arrays already evaluated return at once; the
    # first is the one wait.
    mx.eval = counted
    try:
        world.check()
    finally:
        mx.eval = real_eval
    first = [x for arg in evaluations[0] for x in (arg if isinstance(arg, list) else [arg])]
    assert len(evaluations[0]) == 3 and len(first) >= 2 + 2 * len(MASK_CHECKS) + 2


class WritesIntoItsLastMask(tqbatch.BatchTurboQuantKVCache):
    """Each ``make_mask`` writes into the array the previous call returned: what was
    returned then was right, and is judged as it was."""

    def make_mask(self, *args, **kwargs):
        last = getattr(self, "_last", None)
        if isinstance(last, mx.array):
            last[...] = False
        self._last = super().make_mask(*args, **kwargs)
        return self._last


def test_a_mask_is_judged_as_it_was_returned():
    world = _world(WritesIntoItsLastMask)
    world.check()


class SizeRaises(Recorded):
    def size(self):
        if self.log is not None:
            raise RuntimeError("no size")
        return super().size()


def test_a_read_that_raises_is_its_checks_failure_and_the_rest_is_read():
    world = _world(SizeRaises)
    world.target.log = []
    failure = _failure(world)
    assert _identities(failure) == ["read@update"]
    assert "RuntimeError: no size" in failure.what
    assert world.target.log == ORDER


class MaskAsserts(Recorded):
    def make_mask(self, n, *args, **kwargs):
        if self.log is not None and n == MASK_CHECKS[1][0]:
            raise AssertionError("a check of the target's own")
        return super().make_mask(n, *args, **kwargs)


def test_an_assertion_from_a_read_ends_the_reading_and_is_raised_by_its_check():
    world = _world(MaskAsserts)
    world.target.log = []
    with pytest.raises(AssertionError, match="a check of the target's own"):
        world.check()
    # Geometry, the first mask's two forms and the one that raised; nothing after it.
    assert world.target.log == ORDER[: 3 + 3]


class EmptyRaises(Recorded):
    def empty(self):
        if self.log is not None:
            raise RuntimeError("cannot tell")
        return super().empty()


def test_a_target_that_cannot_say_whether_it_is_empty_is_not_dequantized():
    world = _world(EmptyRaises)
    world.target.log = []
    failure = _failure(world)
    assert _identities(failure) == ["read@update"] and "cannot tell" in failure.what
    assert world.target.log == ORDER[:-1]


class SizeUnreadable(Recorded):
    """Reading the ``size`` attribute itself raises, where the harness reads it."""

    def _read(self, name):
        if name == "size":
            raise RuntimeError("no size attribute")


def test_an_attribute_that_cannot_be_read_is_its_checks_failure():
    world = _world(SizeUnreadable)
    world.target.log = []
    failure = _failure(world)
    assert _identities(failure) == ["read@update"] and "no size attribute" in failure.what
    assert world.target.log == [name for name in ORDER if name != "size"]
