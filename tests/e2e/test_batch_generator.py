"""mlx-lm's own ``BatchGenerator`` drives tqbatch caches, unpatched.

``BatchGenerator`` builds per-request caches with ``make_prompt_cache(model)``
(the model's ``make_cache()``), merges them with ``caches[0][layer].merge``,
prefills right-padded (``prepare`` + ``finalize``), joins batches with
``extend``, and on finish calls ``extract`` then ``filter``. mlx-vlm's
``TurboQuantKVCache`` has no ``merge``; ``BatchableTurboQuantKVCache`` adds the
one that builds a ``BatchTurboQuantKVCache``.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_vlm.turboquant import TurboQuantKVCache

import tqbatch.mlx_lm
from tqbatch import BatchableTurboQuantKVCache, BatchTurboQuantKVCache
from tqbatch.workbench.e2e import LOGITS_ATOL, reference_run
from tqbatch.workbench.serving import MaskWidthProbe

from .conftest import BITS, SEED, SPEC
from .support import drain

# BatchGenerator can be neither teacher-forced nor tapped, so these tests compare
# logits with the requests run alone at LOGITS_ATOL, which holds at float32 only
# (noise ~1e-5). Seen on an H200 at TF32: 1.3e-4, and 5.1e-2 where a code flipped.
tf32 = pytest.mark.float32_only(
    reason="logits vs alone at 1e-4 need float32 matmuls; the model matrix checks "
    "the same paths with its cache oracle at TF32",
)

DENSE = [SPEC.num_layers - 1]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [100, 200, 300, 400, 5, 6, 7, 8, 9, 10, 11]]
MAX_TOKENS = [6, 4, 5]


def _caches(model) -> list:
    """One request's caches: tqbatch's factory, the last layer dense as mlx-vlm's rule keeps it."""
    return tqbatch.mlx_lm.make_prompt_cache(model, bits=BITS, seed=SEED, dense_layers=DENSE)


@pytest.fixture
def probed(model):
    """The model with tqbatch's ``make_cache`` and the mask-width probe installed."""
    had, before = "make_cache" in vars(model), vars(model).get("make_cache")
    tqbatch.mlx_lm.install_make_cache(model, bits=BITS, seed=SEED, dense_layers=DENSE)
    probe = MaskWidthProbe(model)
    yield model, probe
    probe.remove()
    if had:
        model.make_cache = before
    else:
        del model.make_cache


def _assert_matches_alone(model, history, tokens, logprobs):
    ref = reference_run(model, history, len(tokens), bits=BITS, seed=SEED, dense_layers=DENSE)
    assert tokens == ref.tokens
    for mine, logits in zip(logprobs, ref.logits):
        alone = logits - mx.logsumexp(logits)
        # Same reason as LOGITS_ATOL: same packed codes, only float32 order differs.
        assert mx.abs(mine - alone).max().item() <= LOGITS_ATOL


@tf32
def test_batch_generator_with_tqbatch_caches_equals_requests_alone(probed):
    model, probe = probed
    gen = BatchGenerator(model, max_tokens=8, prefill_batch_size=2, completion_batch_size=3)
    gen.insert(PROMPTS[:2], max_tokens=MAX_TOKENS[:2])
    tokens, logprobs, caches = drain(
        gen, late=lambda: gen.insert(PROMPTS[2:], max_tokens=MAX_TOKENS[2:])
    )

    assert sorted(tokens) == [0, 1, 2]
    for uid, prompt in enumerate(PROMPTS):
        assert len(tokens[uid]) == MAX_TOKENS[uid]
        _assert_matches_alone(model, prompt, tokens[uid], logprobs[uid])
        # extract(): the prompt and every returned token (all were fed).
        held = len(prompt) + MAX_TOKENS[uid]
        assert [type(c) for c in caches[uid]] == [BatchableTurboQuantKVCache] * 3 + [KVCache]
        assert all(int(c.offset) == held for c in caches[uid])
    assert probe.checks > 0


def test_batch_generator_merges_into_tqbatch_and_batch_kv_caches(probed):
    model, _ = probed
    caches = [_caches(model) for _ in range(2)]
    merged = [caches[0][i].merge([c[i] for c in caches]) for i in range(SPEC.num_layers)]
    # A batch's class is BatchTurboQuantKVCache configured for its bits and seed.
    assert [type(c) for c in merged] == [
        BatchTurboQuantKVCache.configured(bits=BITS, seed=SEED)
    ] * 3 + [BatchKVCache]


@tf32
def test_extracted_caches_resume_a_conversation(probed):
    """A finished request's caches, re-inserted with a follow-up, continue it exactly."""
    model, _ = probed
    gen = BatchGenerator(model, max_tokens=4, prefill_batch_size=2, completion_batch_size=2)
    gen.insert(PROMPTS[:2], max_tokens=[4, 3])
    first_tokens, _, first_caches = drain(gen)

    follow_ups = [[42, 43, 44], [7]]
    # extract() returns caches BatchGenerator can merge again: no conversion.
    resumed = [first_caches[uid] for uid in range(2)]
    assert all(
        isinstance(c, BatchableTurboQuantKVCache)
        for layers in resumed
        for c in layers
        if isinstance(c, TurboQuantKVCache)
    )
    gen.insert(follow_ups, max_tokens=[3, 4], caches=resumed)
    tokens, logprobs, _ = drain(gen)

    for (uid, new_uid), follow in zip(((0, 2), (1, 3)), follow_ups):
        history = PROMPTS[uid] + first_tokens[uid] + follow
        _assert_matches_alone(model, history, tokens[new_uid], logprobs[new_uid])


def test_mlx_vlm_cache_alone_cannot_be_batched_by_mlx_lm(model, monkeypatch):
    """Why the subclass exists: mlx_lm.generate._merge_caches needs ``merge``."""
    monkeypatch.setattr(
        model,
        "make_cache",
        lambda: [TurboQuantKVCache(bits=BITS, seed=SEED) for _ in range(SPEC.num_layers)],
        raising=False,
    )
    gen = BatchGenerator(model, max_tokens=2)
    gen.insert(PROMPTS[:2])
    with pytest.raises(ValueError, match="does not yet support batching with history"):
        gen.next_generated()
