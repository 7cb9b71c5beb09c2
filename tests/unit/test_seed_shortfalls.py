"""The eight places where the omlx seed falls short, one test group each.

Each test fails on the seed's behaviour (see tqbatch.testing.mutants for a
subclass re-introducing each defect; ``TQBATCH_IMPL=tqbatch.testing.mutants:X``
points these tests at one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from .support import (
    Impl,
    Lockstep,
    assert_attention_matches,
    assert_rejected,
    leaves,
    observe,
)

# ---------------------------------------------------------------- 1. filter compacts


def test_filter_compacts_shared_left_padding(rng):
    ls = Lockstep.merge([12, 3, 5], rng)  # merge allocates exactly the written slots
    slot_bytes = ls.tq.nbytes // (3 * 12)  # bytes of one slot of one row, K and V
    ls.filter([1, 2])  # the only unpadded row leaves: 7 columns are dead for both
    ls.check_geometry()  # mask width, left padding, size() as BatchKVCache: 5, not 12
    assert ls.tq.size() == 5
    assert ls.tq.make_mask(1).shape[-1] == ls.dense.make_mask(1).shape[-1] == 6
    # dead columns are freed, not just hidden
    assert ls.tq.nbytes == 2 * 5 * slot_bytes
    ls.check_rows()


def test_mask_width_stays_in_lockstep_over_many_filter_extend_cycles(rng):
    """The seed's masks grew with every cycle (259 columns against 12)."""
    ls = Lockstep.merge([6, 2], rng)
    for cycle in range(6):
        ls.update(rng, 1)
        newcomer = Lockstep.merge([2 + cycle % 3], rng)
        ls.extend(newcomer)
        ls.filter([1, 2])  # the oldest request finishes
        ls.check_geometry()
    ls.check_rows()
    assert ls.tq.make_mask(1).shape[-1] < 12
    assert_attention_matches(ls.attend(rng, 1))


# ---------------------------------------------------------------- 2. finalize is bit-exact


@pytest.mark.parametrize("bits", [3, 3.5, 4])
@pytest.mark.parametrize("dim", [64, 80])
def test_finalize_keeps_packed_bits_exactly(bits, dim, rng):
    """After finalize, every row's packed state is bit-identical to the request's
    single-request cache (check_rows compares packed arrays with array_equal):
    a dequantize/roll/re-quantize finalize is close but not identical."""
    ls = Lockstep.new([0, 0, 0], bits=bits, dim=dim)
    ls.prepare(right_padding=[3, 0, 1])
    ls.update(rng, 7)
    ls.finalize()
    ls.check()
    assert_attention_matches(ls.attend(rng, 1, q_heads=4))
    ls.check()


# ---------------------------------------------------------------- 3. trim at B > 1


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_trim_after_multi_token_verify_block(accepted, rng):
    """Speculative decoding: verify a 4-token draft block, keep ``accepted`` of it."""
    ls = Lockstep.merge([5, 3, 4], rng)
    assert_attention_matches(ls.attend(rng, 4, q_heads=4))  # the verify forward pass
    assert ls.trim(4 - accepted) == 4 - accepted
    ls.check()
    assert_attention_matches(ls.attend(rng, 1, q_heads=4))  # decode goes on from there
    ls.check()


# ---------------------------------------------------------------- 4. size() is an int


def test_size_is_an_int_through_a_lifecycle(rng):
    ls = Lockstep.new([1, 0])
    sizes = [ls.tq.size()]
    ls.update(rng, 3)
    sizes.append(ls.tq.size())
    ls.extend(Lockstep.merge([5], rng))
    sizes.append(ls.tq.size())
    ls.filter([0, 2])
    sizes.append(ls.tq.size())
    ls.trim(1)
    sizes.append(ls.tq.size())
    ls.roundtrip()
    sizes.append(ls.tq.size())
    assert all(type(s) is int for s in sizes), [type(s) for s in sizes]
    ls.check_geometry()


# ---------------------------------------------------------------- 5. state round trip


def test_state_round_trip_at_batch_keeps_geometry_and_bits(rng):
    ls = Lockstep.merge([6, 2, 0, 4], rng)
    ls.update(rng, 2)
    donor = ls.tq
    before = observe(donor)
    ls.roundtrip()
    restored = ls.tq
    after = observe(restored)
    # identical observables, including every packed byte; only the allocated
    # capacity (nbytes) may differ: the state carries written slots only
    before.pop("nbytes"), after.pop("nbytes")
    assert after == before
    ls.check()


def test_restored_copy_shares_no_array_with_its_donor(rng):
    ls = Lockstep.merge([6, 2, 4], rng)
    ls.update(rng, 1)
    donor = ls.tq
    restored = Impl.from_state(donor.state, donor.meta_state)

    def arrays(cache):
        out = leaves((cache.keys, cache.values))
        return out + [cache.offset, cache.left_padding]

    donor_ids = {id(a) for a in arrays(donor)}
    assert not donor_ids & {id(a) for a in arrays(restored)}

    # Behaviourally: trimming and rewriting the donor (in-place writes into its
    # buffers) must not reach the restored copy, nor the other way round.
    snapshot = observe(restored)
    donor.trim(2)
    donor.update_and_fetch(mx.full((3, 2, 2, 64), 5.0), mx.full((3, 2, 2, 64), -5.0))
    donor.filter([2, 0])
    assert observe(restored) == snapshot

    fresh = Impl.from_state(restored.state, restored.meta_state)
    snapshot = observe(fresh)
    restored.trim(1)
    restored.update_and_fetch(mx.full((3, 2, 1, 64), 3.0), mx.full((3, 2, 1, 64), 3.0))
    assert observe(fresh) == snapshot


def test_state_setter_copies_the_arrays_it_is_given(rng):
    ls = Lockstep.merge([3, 5], rng)
    state = ls.tq.state
    kept = [np.array(a) for a in leaves(state)]
    target = Impl([0, 0])
    target.state = state
    target.meta_state = ls.tq.meta_state
    target.trim(2)
    target.update_and_fetch(mx.full((2, 2, 2, 64), 4.0), mx.full((2, 2, 2, 64), 4.0))
    for a, b in zip(leaves(state), kept):
        np.testing.assert_array_equal(np.array(a), b)


# ---------------------------------------------------------------- 6. B = 1 with real padding


def _b1_left_padded_run(poison_seed: int):
    rng = np.random.default_rng(42)
    ls = Lockstep.new([0])
    ls.prepare(left_padding=[3])
    poison = np.random.default_rng(poison_seed)
    pairs = ls.attend(rng, 8, poison_rng=poison)  # prefill: 3 padding + 5 real tokens
    ls.check()
    pairs += ls.attend(rng, 1)
    pairs += ls.attend(rng, 2, q_heads=4)
    ls.check()
    return pairs


def test_batch_of_one_with_left_padding_never_attends_padding():
    first = _b1_left_padded_run(poison_seed=1)
    assert_attention_matches(first)  # equal to attention over the real tokens alone
    second = _b1_left_padded_run(poison_seed=2)
    for (a, *_), (b, *_) in zip(first, second):  # and the poison does not move anything
        np.testing.assert_array_equal(np.array(a), np.array(b))


def _b1_right_padded_run(poison_seed: int):
    rng = np.random.default_rng(43)
    ls = Lockstep.new([0])
    ls.prepare(right_padding=[3])
    poison = np.random.default_rng(poison_seed)
    pairs = ls.attend(rng, 8, poison_rng=poison)  # prefill: 5 real tokens + 3 padding
    ls.finalize()
    ls.check()
    assert ls.tq.left_padding.tolist() == [3] and ls.tq.offset.tolist() == [5]
    pairs += ls.attend(rng, 1)
    pairs += ls.attend(rng, 3, q_heads=4)
    ls.check()
    return pairs


def test_batch_of_one_with_right_padding_never_attends_padding_after_finalize():
    first = _b1_right_padded_run(poison_seed=1)
    assert_attention_matches(first)
    second = _b1_right_padded_run(poison_seed=2)
    for (a, *_), (b, *_) in zip(first, second):
        np.testing.assert_array_equal(np.array(a), np.array(b))


# ---------------------------------------------------------------- 7. codec rebuild from disk


def _save(path, cache):
    """The state arrays to safetensors, meta_state strings as metadata (as a server would)."""
    arrays = dict(tree_flatten(list(cache.state)))
    mx.save_safetensors(str(path), arrays, {"meta_state": json.dumps(list(cache.meta_state))})


def _load(path):
    """Only what the file holds: nothing shared with the process that wrote it."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    state = tree_unflatten(list(arrays.items()))  # NamedTuples come back as lists
    return Impl.from_state(state, tuple(json.loads(metadata["meta_state"])))


@pytest.mark.parametrize("dim", [64, 80, 96, 128])
@pytest.mark.parametrize("bits", [3, 3.5, 4])
def test_codec_rebuild_after_restore_from_disk(dim, bits, rng, tmp_path):
    """D * bits not a multiple of 32 (D=80 at 3 bits -> 240) was rebuilt as D=85 by the seed."""
    ls = Lockstep.merge([4, 1, 3], rng, bits=bits, seed=5, dim=dim)
    ls.update(rng, 2)
    donor = ls.tq
    _save(tmp_path / "cache.safetensors", donor)
    restored = _load(tmp_path / "cache.safetensors")
    assert restored.key_codec.dim == dim and restored.value_codec.dim == dim
    assert (restored.bits, restored.seed) == (donor.bits, donor.seed)
    for got, want in zip(restored.dequantize(), donor.dequantize()):
        assert got.shape == want.shape
        # the same packed bits through a codec rebuilt from (D, bits, seed): exact
        np.testing.assert_array_equal(np.array(got), np.array(want))
    ls.tq = restored
    ls.check()
    assert_attention_matches(ls.attend(rng, 1))  # and it quantizes new tokens the same way
    ls.check()


def test_restore_in_a_fresh_process(tmp_path, rng):
    """A real fresh process: no codec, table or array survives from the writer."""
    ls = Lockstep.merge([5, 2], rng, bits=3, seed=8, dim=80)
    _save(tmp_path / "cache.safetensors", ls.tq)
    keys, values = ls.tq.dequantize()
    np.save(tmp_path / "keys.npy", np.array(keys))
    np.save(tmp_path / "values.npy", np.array(values))
    script = textwrap.dedent(
        f"""
        import json, sys
        import mlx.core as mx, numpy as np
        from mlx.utils import tree_unflatten
        from tqbatch.testing.target import load_impl
        arrays, meta = mx.load(sys.argv[1] + "/cache.safetensors", return_metadata=True)
        cache = load_impl().from_state(
            tree_unflatten(list(arrays.items())), tuple(json.loads(meta["meta_state"]))
        )
        assert cache.key_codec.dim == 80, cache.key_codec.dim
        k, v = cache.dequantize()
        np.testing.assert_array_equal(np.array(k), np.load(sys.argv[1] + "/keys.npy"))
        np.testing.assert_array_equal(np.array(v), np.load(sys.argv[1] + "/values.npy"))
        assert cache.offset.tolist() == {ls.tq.offset.tolist()}
        print("restored")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )
    assert done.returncode == 0 and "restored" in done.stdout, done.stderr[-2000:]


# ---------------------------------------------------------------- 8. mixed configurations


MIXED = [
    ((4.0, 101), (3.5, 202)),
    ((4.0, 101), (4.0, 202)),
    ((3.0, 101), (4.0, 101)),
]


def _names_both(message: str, a, b):
    for bits, seed in (a, b):
        assert str(bits) in message and str(seed) in message, message


@pytest.mark.parametrize("a,b", MIXED, ids=str)
def test_merge_rejects_mixed_configurations(a, b, rng):
    from mlx_vlm.turboquant import TurboQuantKVCache

    members = []
    for bits, seed in (a, b):
        c = TurboQuantKVCache(bits=bits, seed=seed)
        c.update_and_fetch(mx.zeros((1, 2, 2, 64)) + 1, mx.zeros((1, 2, 2, 64)) + 1)
        members.append(c)
    with pytest.raises(ValueError) as info:
        Impl.merge(members)
    _names_both(str(info.value), a, b)


@pytest.mark.parametrize("a,b", MIXED, ids=str)
@pytest.mark.parametrize("filled", [True, False])
def test_extend_rejects_mixed_configurations(a, b, filled, rng):
    left = Lockstep.merge([3, 1], rng, bits=a[0], seed=a[1])
    right = (
        Lockstep.merge([2], rng, bits=b[0], seed=b[1])
        if filled
        else Lockstep.new([0], bits=b[0], seed=b[1])
    )
    error = assert_rejected(left.tq, lambda: left.tq.extend(right.tq), ValueError)
    _names_both(str(error), a, b)
    left.check()
