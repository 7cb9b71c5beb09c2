"""The batch's causal mask as per-row start offsets (``tqbatch._masks``).

``CausalRows`` must describe exactly the array mlx-lm's ``create_causal_mask``
builds, the cache must attend with it only where the mask it is given is one
it made (untouched) or completes itself, and attending with it must give the
very floats attending with the array gives.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_vlm.models.base import scaled_dot_product_attention

from tqbatch import _codec, _masks
from tqbatch.testing.oracles.reference import to_numpy

from .support import normal


def _by_definition(starts, offset, n, window):
    """Row b, query l sees column t iff starts[b] <= t <= offset + l (and within the window)."""
    allowed = np.zeros((len(starts), 1, n, offset + n), bool)
    for b, start in enumerate(starts):
        for q in range(n):
            for t in range(offset + n):
                seen = start <= t <= offset + q
                if window is not None:
                    seen = seen and offset + q - t < window
                allowed[b, 0, q, t] = seen
    return allowed


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    starts=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    offset=st.integers(0, 8),
    n=st.integers(1, 4),
    window=st.one_of(st.none(), st.integers(1, 5)),
)
def test_causal_rows_are_the_mask_by_definition(starts, offset, n, window):
    rows = _masks.CausalRows(mx.array(starts, dtype=mx.int32), offset, window)
    got = np.broadcast_to(to_numpy(rows.allowed(n)), (len(starts), 1, n, offset + n))
    np.testing.assert_array_equal(got, _by_definition(starts, offset, n, window))


def _spy_on_attend(monkeypatch) -> list:
    """Record the mask each call of ``tqbatch._codec.attend`` receives (the vectorized
    path, pinned: on CUDA a decode step would otherwise take the fused kernel, whose
    receipt of the rows is tested in ``test_cuda_decode.py``)."""
    monkeypatch.setenv("TQBATCH_DECODE_KERNEL", "vectorized")
    seen, attend = [], _codec.attend

    def spy(*args, **kwargs):
        seen.append(args[6] if len(args) > 6 else kwargs.get("mask"))
        return attend(*args, **kwargs)

    monkeypatch.setattr(_codec, "attend", spy)
    return seen


@pytest.mark.parametrize("queries", [1, 3])
def test_the_cache_attends_its_own_mask_as_row_starts_with_the_same_floats(
    batch, rng, queries, monkeypatch
):
    """Its own mask goes in as numbers; a copy of it as the array; both give the same output."""
    seen = _spy_on_attend(monkeypatch)
    tq = batch.tq
    mask = tq.make_mask(queries, return_array=True)
    copy = mx.array(to_numpy(mask))  # equal content, another object: not the cache's
    q = normal(rng, (batch.batch, batch.heads, queries, batch.dim))
    kv = normal(rng, (batch.batch, batch.heads, queries, batch.dim))
    ks, vs = tq.update_and_fetch(kv, kv)
    scale = batch.dim**-0.5
    by_rows = scaled_dot_product_attention(q, ks, vs, tq, scale=scale, mask=mask)
    by_array = scaled_dot_product_attention(q, ks, vs, tq, scale=scale, mask=copy)
    assert isinstance(seen[0], _masks.CausalRows)
    np.testing.assert_array_equal(to_numpy(seen[0].starts), to_numpy(tq.left_padding))
    assert seen[0].offset + queries == tq.size()
    assert seen[0].array is mask  # the array already made is reused, not rebuilt
    assert seen[1] is copy
    # Same codes, same boolean mask, same ops: the very same floats.
    np.testing.assert_array_equal(to_numpy(by_rows), to_numpy(by_array))


def test_a_decode_step_without_a_mask_attends_the_rows_starts(batch, rng, monkeypatch):
    """mlx-vlm's qwen3_5 passes no mask at decode: the padding must still be skipped."""
    seen = _spy_on_attend(monkeypatch)
    tq = batch.tq
    own = tq.make_mask(1, return_array=True)
    q = normal(rng, (batch.batch, batch.heads, 1, batch.dim))
    kv = normal(rng, (batch.batch, batch.heads, 1, batch.dim))
    ks, vs = tq.update_and_fetch(kv, kv)
    without = scaled_dot_product_attention(q, ks, vs, tq, scale=0.25, mask=None)
    with_own = scaled_dot_product_attention(q, ks, vs, tq, scale=0.25, mask=mx.array(own))
    assert isinstance(seen[0], _masks.CausalRows)
    np.testing.assert_array_equal(to_numpy(without), to_numpy(with_own))


def test_a_mask_made_for_another_length_stays_an_array(batch, rng, monkeypatch):
    """A remembered mask whose columns do not match the keys is not taken for the cache's own."""
    seen = _spy_on_attend(monkeypatch)
    tq = batch.tq
    stale = tq.make_mask(1, return_array=True)  # made for size() + 1 keys
    for _ in range(2):  # now the state holds size() + 2
        kv = normal(rng, (batch.batch, batch.heads, 1, batch.dim))
        ks, vs = tq.update_and_fetch(kv, kv)
    q = normal(rng, (batch.batch, batch.heads, 1, batch.dim))
    with pytest.raises(ValueError):  # an array one column short: SDPA refuses it
        mx.eval(scaled_dot_product_attention(q, ks, vs, tq, scale=0.25, mask=stale))
    assert seen[0] is stale


def test_remembered_masks_are_forgotten_with_their_arrays(batch):
    """The record of masks made does not grow with the steps of a long generation."""
    gc.collect()
    before = len(_masks._made)
    for _ in range(200):
        mx.eval(batch.tq.make_mask(1, return_array=True))
    gc.collect()
    assert len(_masks._made) == before


def test_causal_rows_for_another_key_count_are_refused():
    from mlx_vlm.turboquant import _TurboQuantMSECodec

    codec = _TurboQuantMSECodec(32, 4, seed=0)
    kv = normal(np.random.default_rng(0), (1, 1, 5, 32))
    state = _codec.quantize(codec, kv)
    rows = _masks.CausalRows(mx.array([0], dtype=mx.int32), offset=2)  # 3 keys for 1 query
    with pytest.raises(ValueError, match="state holds 5"):
        _codec.attend(kv[:, :, :1], state, state, codec, codec, 1.0, rows)
