"""Ragged speculative rollback in mlx-vlm's Gemma 4: refused with the cache under test as with
``BatchKVCache``, at the same layer, with the same effect on every layer.

mlx-vlm 0.7.10's ``gemma4.language.LanguageModel.rollback_speculative_cache``
walks the layer caches in order: each is trimmed by ``block - max(accepted) - 1``,
then the first one that has ``_idx`` and keys raises ``RuntimeError`` if the
rows accepted different counts. The cache never sees ``accepted`` (only
``trim(n)``), so a cache without ``_idx`` can neither refuse nor roll rows back
one by one there; tqbatch has no ``_idx`` on purpose (lfm2, qwen3_5 and apc
take an ``_idx`` cache for a dense one). The guard fires anyway, on the layers
mlx-vlm keeps out of TurboQuant in every Gemma 4 batch (``_make_cache``):
sliding layers (``BatchRotatingKVCache``, layer 0 whenever
``sliding_window_pattern > 1``, as in Gemma 4's configs) and the last layer
(``BatchKVCache``, ``should_quantize_kv_layer``). Layer 0 refuses before any
quantized layer is touched, so the cache under test is left exactly as it was.
(mlx-vlm's own generators never get here: Gemma 4 sets
``requires_uniform_batch_acceptance`` and they clamp accepts first.) Where no
cache ahead of the quantized layers has ``_idx`` the guard cannot protect them
(a pinned xfail); mlx-vlm's cache transaction rolls them back exactly (last test).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_vlm.speculative.cache_state import commit_speculative_round
from mlx_vlm.speculative.common import verify_forward

from tqbatch import BatchTurboQuantKVCache
from tqbatch.workbench import model_matrix, vlm_families

GEMMA4 = vlm_families.SPECS["gemma4"]


@pytest.fixture(scope="module")
def gemma4():
    return GEMMA4.build()


def _all_full_attention_gemma4():
    """The tiny gemma4 with two full-attention layers: mlx-vlm quantizes both."""
    from mlx_vlm.models.gemma4.config import TextConfig
    from mlx_vlm.models.gemma4.language import LanguageModel

    params = dict(GEMMA4.config, num_hidden_layers=2)
    params["layer_types"] = ["full_attention"] * 2
    mx.random.seed(0)
    model = LanguageModel(TextConfig.from_dict(params))
    mx.eval(model.parameters())
    return model


def _snapshot(cache) -> list:
    """Everything a rollback could change: state arrays, meta_state, size()."""
    leaves = [v for _, v in tree_flatten([cache.state, cache.meta_state, cache.size()])]
    return [np.array(v) if isinstance(v, mx.array) else v for v in leaves]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(a, b)
    )


def _ragged_rollback(model, target: model_matrix.Target, accepted: list[int], block: int):
    """Prefill, verify a block and commit ``accepted`` as mlx-vlm's decoders do for
    Gemma 4; -> (the error, indices of changed layers, caches)."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]][: len(accepted)]
    longest = max(map(len, prompts))
    padding = [longest - len(p) for p in prompts]
    caches = target.batch_caches(model, padding, GEMMA4)
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)], dtype=mx.int32)
    mx.eval(vlm_families.forward(model, tokens, caches))
    # speculative/dflash.py's _dflash_verify: a model with its own rollback verifies
    # in one call; gdn_states is then None and the commit goes to that rollback.
    drafts = mx.arange(block * len(accepted), dtype=mx.int32).reshape(len(accepted), block)
    output = model(drafts + 20, cache=caches, speculative_verify=True)
    mx.eval(output.logits)
    before = [_snapshot(c) for c in caches]
    with pytest.raises(RuntimeError, match="requires uniform per-row acceptance") as raised:
        commit_speculative_round(model, caches, output.gdn_states, mx.array(accepted), block)
    changed = [i for i, c in enumerate(caches) if not _same(before[i], _snapshot(c))]
    return raised.value, changed, caches


@pytest.mark.parametrize(
    ("accepted", "block"),
    [
        ([2, 0], 4),  # trims 1 from every row, row 1 would keep 2 rejected tokens
        ([3, 1], 4),  # a row accepted everything: nothing is trimmed
        ([0, 2, 1], 3),
    ],
)
def test_ragged_rollback_is_refused_as_for_batchkvcache(gemma4, impl, accepted, block):
    target = model_matrix.Target("under test", impl)
    dense_error, dense_changed, _ = _ragged_rollback(
        gemma4, model_matrix.target_for(model_matrix.BASELINE), accepted, block
    )
    error, changed, caches = _ragged_rollback(gemma4, target, accepted, block)

    assert type(error) is type(dense_error) and str(error) == str(dense_error)
    # Only layer 0 (sliding, the refusing cache), trimmed before it refused, and
    # only when there was something to trim; the same in both columns.
    assert changed == dense_changed == ([0] if block - max(accepted) - 1 > 0 else [])
    quantized = [i for i, c in enumerate(caches) if isinstance(c, impl)]
    assert quantized and not set(quantized) & set(changed)


@pytest.mark.xfail(
    strict=True,
    raises=pytest.fail.Exception,
    reason="a known gap: the guard keys on `_idx`, which tqbatch does not have",
)
def test_a_batch_of_only_tqbatch_layers_is_not_refused():
    """Where no cache in the list has ``_idx`` (a Gemma 4 of at most two layers, all
    full attention: every layer quantized), gemma4's rollback trims every row to the
    longest accept and returns, leaving shorter rows' rejected tokens attended; with
    ``BatchKVCache`` it refuses. (With more such layers it refuses at the last,
    unquantized one, after trimming the quantized ones.) Callers must clamp accepts
    (``requires_uniform_batch_acceptance``) or roll back through mlx-vlm's cache
    transaction, which rolls tqbatch's rows back one by one, exactly."""
    model = _all_full_attention_gemma4()
    _ragged_rollback(model, model_matrix.target_for(model_matrix.BASELINE), [2, 0], 4)
    _ragged_rollback(model, model_matrix.target_for("tqbatch"), [2, 0], 4)


@pytest.mark.parametrize("layout", ["sliding and full", "full only"])
def test_mlx_vlms_cache_transaction_rolls_tqbatch_rows_back_exactly(gemma4, layout):
    """The way round the gap: verify in mlx-vlm's cache transaction (``verify_forward``)
    and commit ragged accepts through it; each tqbatch row then holds exactly the
    packed bits of its prompt and accepted tokens, the rejected ones gone."""
    model = gemma4 if layout == "sliding and full" else _all_full_attention_gemma4()
    accepted, block = [2, 0], 4
    caches = model_matrix.target_for("tqbatch").batch_caches(model, [0, 3], GEMMA4)
    prompts = mx.array([[5, 6, 7, 8, 9, 10], [0, 0, 0, 11, 12, 13]], dtype=mx.int32)
    mx.eval(vlm_families.forward(model, prompts, caches))
    drafts = mx.array([[21, 22, 23, 24], [25, 26, 27, 28]], dtype=mx.int32)
    output, transaction = verify_forward(model, drafts, caches)
    mx.eval(output.logits)
    quantized = [c for c in caches if isinstance(c, BatchTurboQuantKVCache)]
    whole = [[c.extract(row) for row in range(2)] for c in quantized]

    commit_speculative_round(model, caches, transaction, accepted, block)

    kept = [6 + accepted[0] + 1, 3 + accepted[1] + 1]
    for cache, rows in zip(quantized, whole, strict=True):
        assert cache.offset.tolist() == kept
        assert cache.left_padding.tolist() == [max(kept) - n for n in kept]
        for row, (n, before) in enumerate(zip(kept, rows)):
            after = cache.extract(row)
            for got, want in zip(
                (*after.keys, *after.values), (*before.keys, *before.values), strict=True
            ):
                assert np.array_equal(np.array(got), np.array(want[:, :, :n]))
