"""The ``rollback`` op (tqbatch/testing/contract/ops/rollback.py): a ragged speculative commit.

The op must be what a speculative server does: its effect on a cache equals
mlx-vlm's own commit of a ragged accept
(``mlx_vlm.speculative.cache_state.rollback_speculative_cache`` without a
transaction), on mlx-lm's ``BatchKVCache`` and on tqbatch's cache alike. A
malformed op is the scenario's mistake: refused before the target sees it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_vlm.speculative.cache_state import rollback_speculative_cache

from tqbatch import BatchTurboQuantKVCache
from tqbatch.testing.mutants import FinalizeForgetsPaddingAfterWrite
from tqbatch.testing.oracles.reference import as_ints
from tqbatch.testing.world import World

H, D = 2, 64


@st.composite
def verify_rounds(draw):
    """Prompt lengths, a verify block and each row's accepted drafts (< block)."""
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    block = draw(st.integers(1, 4))
    accepted = draw(
        st.lists(st.integers(0, block - 1), min_size=len(lengths), max_size=len(lengths))
    )
    return lengths, block, accepted


def _world_after(impl, lengths, block, accepted) -> World:
    world = World(impl, bits=4.0, seed=0, kv_heads=H, head_dim=D)
    for op in (
        {"op": "merge", "lengths": lengths, "kv_seed": 7},
        {"op": "update", "tokens": block, "kv_seed": 8},
        # mlx-vlm keeps accepted + 1 of the block's tokens: the pending one and the drafts.
        {"op": "rollback", "n": [block - 1 - a for a in accepted]},
    ):
        world.apply(op)
        world.check()
    return world


def _same_writes(cache_factory, merge, lengths, block):
    """A batch built from the world's K/V (same seeds, same generation) by ``merge``."""
    rng = np.random.default_rng(7)
    singles = []
    for n in lengths:
        k = (rng.standard_normal((H, n, D))).astype(np.float32)
        v = (rng.standard_normal((H, n, D))).astype(np.float32)
        single = cache_factory()
        single.update_and_fetch(mx.array(k[None]), mx.array(v[None]))
        singles.append(single)
    batch = merge(singles)
    rng = np.random.default_rng(8)
    shape = (len(lengths), H, block, D)
    keys = rng.standard_normal(shape).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    batch.update_and_fetch(mx.array(keys), mx.array(values))
    return batch


@settings(max_examples=25, deadline=None)
@given(verify_rounds())
def test_rollback_is_mlx_vlms_commit_of_a_ragged_accept(round_):
    lengths, block, accepted = round_
    world = _world_after(BatchTurboQuantKVCache, lengths, block, accepted)

    # mlx-lm's BatchKVCache through mlx-vlm's commit: the geometry the dense reference reached.
    dense = _same_writes(KVCache, BatchKVCache.merge, lengths, block)
    rollback_speculative_cache([dense], None, accepted, block)
    assert as_ints(dense.offset) == world.numpy_model.offsets
    assert as_ints(dense.left_padding) == world.numpy_model.left_padding
    assert dense._idx == world.numpy_model.end

    # tqbatch's cache through mlx-vlm's commit: the very bytes the op left in the target.
    def single():
        return world.single()

    direct = _same_writes(single, BatchTurboQuantKVCache.merge, lengths, block)
    rollback_speculative_cache([direct], None, accepted, block)
    assert as_ints(direct.offset) == as_ints(world.target.offset)
    assert as_ints(direct.left_padding) == as_ints(world.target.left_padding)
    for mine, theirs in zip(direct.dequantize(), world.target.dequantize()):
        assert np.array_equal(np.array(mine), np.array(theirs))


def test_the_mutant_that_forgets_late_right_padding_fails_at_the_rollback():
    with pytest.raises(AssertionError, match=r"^\[offset\] after \{\"op\": \"rollback\""):
        _world_after(FinalizeForgetsPaddingAfterWrite, [3, 5, 2], 3, [0, 2, 1])


@pytest.mark.parametrize(
    ("n", "why"),
    [([1, 0], "for each of the 3 rows"), ([1, -1, 0], "for each of the 3 rows")],
)
def test_a_malformed_rollback_is_refused_before_the_target_sees_it(n, why):
    world = World(BatchTurboQuantKVCache, kv_heads=H, head_dim=D)
    world.apply({"op": "merge", "lengths": [2, 3, 1], "kv_seed": 1})
    before = as_ints(world.target.offset)
    with pytest.raises(ValueError, match=why):
        world.apply({"op": "rollback", "n": n})
    assert as_ints(world.target.offset) == before
    assert world.ops[-1]["op"] == "merge"  # not recorded as applied


def test_a_rollback_while_right_padding_is_pending_is_refused():
    world = World(BatchTurboQuantKVCache, kv_heads=H, head_dim=D)
    world.apply({"op": "new", "left_padding": [0, 0]})
    world.apply({"op": "prepare", "left_padding": None, "right_padding": [1, 0]})
    world.apply({"op": "update", "tokens": 3, "kv_seed": 1})
    with pytest.raises(ValueError, match="finalize the prefill first"):
        world.apply({"op": "rollback", "n": [1, 1]})


def test_mlx_vlms_own_class_cannot_take_a_ragged_commit():
    """Where tqbatch's class differs from mlx-vlm's: mlx-vlm's commit refuses a batch of its
    own class once rows accept different numbers of drafts (it has ``_idx`` and no per-row
    trim), and takes an even accept."""
    from mlx_vlm.turboquant import BatchTurboQuantKVCache as VlmBatch

    def written():
        batch = VlmBatch([0, 0], bits=4.0)
        rng = np.random.default_rng(3)
        keys, values = (
            mx.array(rng.standard_normal((2, H, 5, D)).astype(np.float32)) for _ in "kv"
        )
        batch.update_and_fetch(keys, values)
        return batch

    with pytest.raises(RuntimeError, match="requires uniform acceptance"):
        rollback_speculative_cache([written()], None, [0, 2], 3)
    even = written()
    rollback_speculative_cache([even], None, [1, 1], 3)
    assert as_ints(even.offset) == [4, 4]
