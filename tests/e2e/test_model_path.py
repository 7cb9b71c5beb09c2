"""The model's attention and RoPE really take the batch path we rely on."""

from __future__ import annotations

import mlx.core as mx
import mlx_vlm.models.base as vlm_base
import pytest
from mlx_lm.models.cache import BatchKVCache
from mlx_vlm.models.qwen2 import language as qwen2_language

from tqbatch.testing.mutants import FilterKeepsOneDeadColumn, FilterWithoutCompaction
from tqbatch.workbench.serving import (
    ContinuousBatcher,
    MaskGeometryError,
    Request,
    TurboQuantLayersAdapter,
)

from .conftest import BITS, SEED, SPEC


def test_attention_is_mlx_vlm_sdpa_with_our_cache(model, impl, monkeypatch):
    # mlx-lm's SDPA breaks on caches with `bits`; the model must call mlx-vlm's.
    assert qwen2_language.scaled_dot_product_attention is vlm_base.scaled_dot_product_attention
    seen = []

    def spy(queries, keys, values, cache, scale, mask, **kwargs):
        seen.append(type(cache))
        return vlm_base.scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs
        )

    monkeypatch.setattr(qwen2_language, "scaled_dot_product_attention", spy)
    server = ContinuousBatcher(
        TurboQuantLayersAdapter(model, bits=BITS, seed=SEED, batch_cache_class=impl), probe=False
    )
    server.admit_left_padded([Request("x", [1, 2, 3], 5), Request("y", [4, 5, 6, 7, 8], 5)])
    server.step()
    batch_class = type(impl([0], bits=BITS, seed=SEED))  # tqbatch's: configured for BITS, SEED
    per_forward = [batch_class] * (SPEC.num_layers - 1) + [BatchKVCache]
    assert seen == per_forward * 2


def test_rope_takes_per_row_offsets(model, impl):
    """``cache.offset`` is a (B,) array and RoPE applies it row by row."""
    cache = impl([0, 3, 5], bits=BITS, seed=SEED)
    assert cache.offset.shape == (3,)
    rope = model.layers[0].self_attn.rope
    x = mx.random.normal((3, SPEC.num_heads, 4, SPEC.head_dim), key=mx.random.key(1))
    offsets = mx.array([7, 0, 12])
    batched = rope(x, offset=offsets)
    for row, offset in enumerate(offsets.tolist()):
        alone = rope(x[row : row + 1], offset=offset)
        # Same per-row computation in mx.fast.rope: equal up to float32 rounding.
        assert mx.allclose(batched[row : row + 1], alone, atol=1e-6, rtol=0).item()


@pytest.mark.parametrize("mutant", [FilterWithoutCompaction, FilterKeepsOneDeadColumn])
def test_probe_reports_dense_and_quantized_layers_disagreeing(model, mutant):
    """A filter that leaves dead columns makes the TurboQuant mask wider than the dense layer."""
    server = ContinuousBatcher(
        TurboQuantLayersAdapter(model, bits=BITS, seed=SEED, batch_cache_class=mutant)
    )
    try:
        longest = Request("long", list(range(1, 12)), 1)  # leaves right after prefill
        server.admit_left_padded([Request("a", [1, 2, 3, 4], 4), longest, Request("b", [5, 6], 4)])
        with pytest.raises(MaskGeometryError, match="BatchKVCache"):
            server.step()
    finally:
        server.probe.remove()
