"""What the seed got right and tqbatch must keep, and the bit widths it supports."""

from __future__ import annotations

import pytest

from .support import Impl, Lockstep, assert_attention_matches

# ---------------------------------------------------------------- writes land at the written end


def test_writes_land_at_the_written_end_after_the_unpadded_row_leaves(rng):
    """max(offset) falls short of the written end once the zero-padding row is
    filtered away (omlx #2172); writing there would overwrite real tokens."""
    ls = Lockstep.merge([8, 3, 5], rng)
    ls.filter([1, 2])
    assert max(ls.tq.offset.tolist()) == ls.tq.size()  # compaction: lockstep says so
    ls.update(rng, 1)
    ls.check()
    assert_attention_matches(ls.attend(rng, 2))
    ls.check()


def test_writes_land_at_the_written_end_not_at_the_allocated_capacity(rng):
    """After decode the buffers have spare capacity (256-slot steps); after a
    filter without shared padding the end is still far below capacity."""
    ls = Lockstep.merge([4, 4, 2], rng)
    ls.update(rng, 1)  # grows the buffers to capacity > size()
    assert ls.tq.nbytes > sum(a.nbytes for a in _written_leaves(ls.tq))
    ls.filter([0, 2])  # row 0 keeps left padding 0: nothing to compact
    ls.update(rng, 1)
    ls.check()
    ls.trim(1)
    ls.update(rng, 2)  # rewrites the trimmed slot, at the written end
    ls.check()


def _written_leaves(cache):
    from .support import leaves

    return leaves(cache.state[:2])


def test_writes_land_at_the_written_end_when_every_row_is_left_padded(rng):
    """Extend pads the shorter side: afterwards no row has zero left padding."""
    ls = Lockstep.merge([3], rng)
    ls.extend(Lockstep.merge([6], rng))
    ls.filter([0])
    ls.update(rng, 1)
    ls.check()


# ---------------------------------------------------------------- empty members and sides


@pytest.mark.parametrize("lengths", [[0, 4], [4, 0, 0], [0, 0]], ids=str)
def test_merge_with_empty_members(lengths, rng):
    ls = Lockstep.merge(lengths, rng)
    ls.check()
    ls.update(rng, 1)  # the empty members start decoding like everyone else
    ls.check()
    assert_attention_matches(ls.attend(rng, 1))


@pytest.mark.parametrize("empty_side", ["self", "other", "both"])
def test_extend_with_an_empty_side(empty_side, rng):
    a = Lockstep.new([0]) if empty_side in ("self", "both") else Lockstep.merge([3, 5], rng)
    b = Lockstep.new([0, 0]) if empty_side in ("other", "both") else Lockstep.merge([2], rng)
    a.extend(b)
    a.check()
    a.update(rng, 2)
    a.check()


# ---------------------------------------------------------------- late join


def test_late_join_after_batch_of_one_decode(rng):
    ls = Lockstep.merge([5], rng)
    for _ in range(3):
        assert_attention_matches(ls.attend(rng, 1))
    ls.extend(Lockstep.merge([2, 9], rng))  # two requests join a running B=1 decode
    ls.check()
    for _ in range(2):
        assert_attention_matches(ls.attend(rng, 1, q_heads=4))
        ls.check()


def test_late_join_into_a_batch_of_one_built_empty(rng):
    ls = Lockstep.new([0])
    ls.update(rng, 4)  # prefill
    ls.update(rng, 1)  # decode
    ls.extend(Lockstep.merge([7], rng))
    ls.check()
    assert_attention_matches(ls.attend(rng, 1))


# ---------------------------------------------------------------- no `_idx`


def _assert_no_idx(cache):
    # mlx-vlm's speculative rollback changes behaviour when it finds `_idx`
    assert "_idx" not in vars(cache)
    assert not hasattr(cache, "_idx")


def test_no_idx_attribute_at_any_point_of_a_lifecycle(rng):
    ls = Lockstep.new([0, 2])
    steps = [
        lambda: None,
        lambda: ls.prepare(right_padding=[1, 0]),
        lambda: ls.update(rng, 4),
        ls.finalize,
        lambda: ls.update(rng, 1),
        lambda: ls.extend(Lockstep.merge([3], rng)),
        lambda: ls.filter([2, 0]),
        lambda: ls.trim(1),
        ls.roundtrip,
        lambda: ls.tq.extract(0),
        lambda: ls.attend(rng, 2),
    ]
    for step in steps:
        step()
        _assert_no_idx(ls.tq)
    _assert_no_idx(Impl.merge([ls.tq.extract(1)]))
    ls.check()


# ---------------------------------------------------------------- bit widths

INTEGER_BITS = [2, 3, 4, 5, 6, 7, 8]
HALF_BITS = [2.5, 3.5, 4.5, 5.5, 6.5, 7.5]


@pytest.mark.parametrize("bits", INTEGER_BITS + HALF_BITS)
def test_every_bit_width_mlx_vlm_accepts(bits, rng):
    ls = Lockstep.merge([4, 1], rng, bits=bits, seed=3)
    assert ls.tq.bits == bits
    ls.prepare(right_padding=[1, 0])
    ls.update(rng, 3)
    ls.finalize()
    ls.filter([1, 0])
    ls.check()
    assert_attention_matches(ls.attend(rng, 1, q_heads=4))
    ls.check()


@pytest.mark.parametrize("key_bits,value_bits", [(2, 4), (3, 3), (8, 2), (None, 3), (5, None)])
def test_integer_key_and_value_bits(key_bits, value_bits, rng):
    kw = {k: v for k, v in (("key_bits", key_bits), ("value_bits", value_bits)) if v is not None}
    ls = Lockstep.merge([3, 5], rng, bits=4, **kw)
    assert ls.tq.key_bits == (key_bits or 4) and ls.tq.value_bits == (value_bits or 4)
    ls.update(rng, 2)
    ls.check()
    assert_attention_matches(ls.attend(rng, 1))
    ls.roundtrip()
    assert (ls.tq.key_bits, ls.tq.value_bits) == (key_bits or 4, value_bits or 4)
    ls.check()


@pytest.mark.parametrize("side", ["key_bits", "value_bits"])
@pytest.mark.parametrize("value", [2.5, 3.5])
def test_fractional_per_side_bits_are_rejected(side, value):
    """mlx-vlm would choose outlier channels from the first tensor it sees:
    two requests would not share a codec."""
    with pytest.raises(ValueError, match=side):
        Impl([0], bits=4, **{side: value})


@pytest.mark.parametrize("bits", [0.5, 2.3, 3.25])
def test_bit_widths_mlx_vlm_rejects_are_rejected(bits):
    with pytest.raises(ValueError, match="bit"):
        Impl([0], bits=bits)
