"""Restore from ``state`` and ``meta_state`` in either order.

mlx-lm's ``from_state`` sets ``state`` then ``meta_state``; omlx's restore sets
``meta_state`` first, or ``meta_state`` alone on an empty cache to hand over
the configuration. Each order must rebuild the saved cache exactly, and a
pair that does not belong together must be refused with the cache unchanged.
"""

from __future__ import annotations

import pytest

from .support import Impl, Lockstep, assert_rejected, normal, observe


def _saved(rng, *, pending: bool = False):
    """A cache after prefill and decode (or mid-prefill, right padding pending)."""
    ls = Lockstep.new([1, 0, 3], bits=3.5, seed=11)
    if pending:
        ls.prepare(right_padding=[2, 0, 1])
    ls.update(rng, 5)
    if not pending:
        ls.finalize()
        ls.update(rng, 1)
    return ls.tq


def _restored_equal(restored, saved):
    # nbytes counts allocated capacity: the saved cache grew in 256-slot steps,
    # the restored one holds exactly the written slots of the state.
    want, got = observe(saved), observe(restored)
    want.pop("nbytes"), got.pop("nbytes")
    assert got == want


@pytest.mark.parametrize("pending", [False, True], ids=["settled", "right_padding_pending"])
def test_meta_state_then_state_on_a_constructed_cache(pending, rng):
    saved = _saved(rng, pending=pending)
    restored = Impl([0])  # any batch size: the state brings the geometry
    restored.meta_state = saved.meta_state
    restored.state = saved.state
    _restored_equal(restored, saved)


@pytest.mark.parametrize("pending", [False, True], ids=["settled", "right_padding_pending"])
def test_meta_state_then_state_on_a_bare_instance(pending, rng):
    saved = _saved(rng, pending=pending)
    restored = Impl.__new__(Impl)
    restored.meta_state = saved.meta_state
    restored.state = saved.state
    _restored_equal(restored, saved)


def test_state_then_meta_state_still_works(rng):
    saved = _saved(rng, pending=True)
    _restored_equal(Impl.from_state(saved.state, saved.meta_state), saved)


def test_meta_state_alone_hands_over_the_configuration(rng):
    """An empty cache takes bits, seed and codecs, and then quantizes as the source."""
    source = Lockstep.merge([4, 2], rng, bits=3.5, seed=11)
    empty = Impl([2, 0])
    empty.meta_state = Impl([0], bits=3.5, seed=11).meta_state
    assert (empty.bits, empty.key_bits, empty.value_bits, empty.seed) == (3.5, 3.0, 4.0, 11)
    assert empty.empty() and empty.left_padding.tolist() == [2, 0]
    empty.meta_state = ("0",) + tuple(source.tq.meta_state[1:])
    assert empty.key_codec.dim == 64  # the head_dim came with it
    keys, values = normal(rng, (2, 2, 3, 64)), normal(rng, (2, 2, 3, 64))
    empty.update_and_fetch(keys, values)
    twin = Impl([2, 0], bits=3.5, seed=11)
    twin.update_and_fetch(keys, values)
    assert observe(empty) == observe(twin)


def test_a_state_that_does_not_match_the_meta_state_before_it_is_refused(rng):
    saved = _saved(rng)
    other = Lockstep.merge([2, 2, 2], rng, bits=3.5, seed=11).tq  # written end 2, not 6
    restored = Impl([0])
    restored.meta_state = saved.meta_state
    assert_rejected(restored, lambda: setattr(restored, "state", other.state), ValueError, "end")
    restored.state = saved.state  # the right one is still accepted
    _restored_equal(restored, saved)


def test_a_state_with_other_rows_than_the_pending_right_padding_is_refused(rng):
    saved = _saved(rng, pending=True)  # right padding for 3 rows
    two_rows = Lockstep.merge([5, 5], rng, bits=3.5, seed=11).tq  # same end, 2 rows
    restored = Impl([0])
    restored.meta_state = saved.meta_state
    assert_rejected(
        restored, lambda: setattr(restored, "state", two_rows.state), ValueError, "right padding"
    )


def test_a_state_with_another_packed_width_than_the_meta_state_is_refused(rng):
    saved = _saved(rng)  # 3.5 bits at head_dim 64
    wide = Lockstep.merge([6, 6, 6], rng, bits=3.5, seed=11, dim=128).tq
    restored = Impl([0])
    restored.meta_state = saved.meta_state
    assert_rejected(restored, lambda: setattr(restored, "state", wide.state), ValueError, "width")


def test_a_write_between_meta_state_and_state_ends_the_restore(rng):
    """Once the cache is used, the meta_state set before no longer constrains a state."""
    saved = _saved(rng)
    restored = Impl([0])
    restored.meta_state = ("0",) + tuple(saved.meta_state[1:])
    restored.update_and_fetch(normal(rng, (1, 2, 2, 64)), normal(rng, (1, 2, 2, 64)))
    restored.state = saved.state
    restored.meta_state = saved.meta_state
    _restored_equal(restored, saved)


def test_a_bad_meta_state_on_an_empty_cache_changes_nothing():
    empty = Impl([1, 0], bits=4.0, seed=0)
    bad = ("0", "3.5", "11", "3.0", "4.0", "64", "64", "1,2,3")  # 3 rows of right padding
    assert_rejected(empty, lambda: setattr(empty, "meta_state", bad), ValueError, "right padding")
    negative = ("-1", "3.5", "11", "3.0", "4.0", "64", "64", "")
    assert_rejected(empty, lambda: setattr(empty, "meta_state", negative), ValueError, "end")
