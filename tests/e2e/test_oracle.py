"""The oracle's own parts: its capture leaves no trace, its code counter counts, it
admits exactly the codes rounding allows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.qwen2 import language as qwen2_language
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.testing.oracles.reference import TurboReferences
from tqbatch.testing.selfcheck.doubles import RoundsFarOtherwise, RoundsOtherwise
from tqbatch.workbench.e2e import flipped_codes, run_scenario
from tqbatch.workbench.serving import ForwardLayout
from tqbatch.workbench.serving_oracle import ServingOracle

from .conftest import BITS, SEED, SPEC


def test_capture_is_removed_even_when_the_forward_raises(model):
    caches = [TurboQuantKVCache(bits=BITS, seed=SEED) for _ in range(SPEC.num_layers)]
    attention = qwen2_language.scaled_dot_product_attention
    oracle = ServingOracle(model, bits=BITS, seed=SEED, quantized_layers=range(SPEC.num_layers))
    layout = ForwardLayout("decode", ("x",), (range(1),))
    update_and_fetch = TurboQuantKVCache.update_and_fetch
    with pytest.raises(RuntimeError, match="boom"):
        with oracle.forward(layout, caches):
            assert TurboQuantKVCache.update_and_fetch is not update_and_fetch
            raise RuntimeError("boom")
    assert TurboQuantKVCache.update_and_fetch is update_and_fetch
    assert qwen2_language.scaled_dot_product_attention is attention
    assert oracle.failures == []  # a crash is the caller's to report, not a failed check


def _cache(keys: np.ndarray, values: np.ndarray) -> TurboQuantKVCache:
    cache = TurboQuantKVCache(bits=BITS, seed=SEED)
    cache.update_and_fetch(mx.array(keys[None]), mx.array(values[None]))
    return cache


def test_flipped_codes_counts_one_changed_token():
    rng = np.random.default_rng(0)
    keys, values = (rng.standard_normal((2, 6, 64)).astype(np.float32) for _ in range(2))
    same = flipped_codes([_cache(keys, values)], [_cache(keys, values)], 6, 64)
    assert same == {"codes": (0, 2 * 2 * 6 * 64), "norms": (0, 2 * 2 * 6)}

    changed = keys.copy()
    changed[1, 4] = rng.standard_normal(64)  # one (head, token) of the keys
    flips = flipped_codes([_cache(changed, values)], [_cache(keys, values)], 6, 64)
    codes, _ = flips["codes"]
    assert 0 < codes <= 64  # only that token's codes can differ
    assert flips["norms"][0] == 1


# ------------------------------------------------------------ rounding choices
# A correct cache may store another code or float16 norm where float rounding
# allows it (another summation order; a GPU). The oracle must pass one, and
# must still fail a cache whose codes move further than rounding can.


def test_a_cache_that_rounds_otherwise_passes_where_it_failed_before(
    model, references, monkeypatch
):
    def run(cls):
        return run_scenario(
            SPEC, bits=BITS, seed=SEED, model=model, references=references, batch_cache_class=cls
        )

    result = run(RoundsOtherwise)
    assert result.failures() == []
    assert result.admitted > 0  # the nudge did move codes or norms
    monkeypatch.setattr(TurboReferences, "admit_rounding", lambda *a: None)
    assert "content" in run(RoundsOtherwise).failure_kinds()


@pytest.mark.float32_only(reason="a 1e-3 nudge is within TF32's rounding band (3.9e-3)")
def test_a_cache_past_the_rounding_band_still_fails(model, references):
    result = run_scenario(
        SPEC,
        bits=BITS,
        seed=SEED,
        model=model,
        references=references,
        batch_cache_class=RoundsFarOtherwise,
        stop_at_first_failure=True,
    )
    assert result.failure_kinds() & {"content", "attention"}, result.failures()
