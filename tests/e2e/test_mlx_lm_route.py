"""mlx-lm's own model classes on tqbatch caches: ``tqbatch.mlx_lm``'s route and cache factory.

Tiny random-weight models of mlx-lm's own code (2 layers, hidden 64, at most 4 query /
2 KV heads, head_dim 32, vocab 256), served by mlx-lm's ``BatchGenerator``
with ``tqbatch.mlx_lm.make_prompt_cache`` and compared with each request run
alone on single-request ``TurboQuantKVCache``s.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base as lm_base

# Imported here, before any route is enabled: the enable/disable test needs
# modules that bound mlx-lm's function before enable() (lm_families imports
# the rest lazily, by name).
from mlx_lm.models import gemma3_text, gpt_oss, lfm2, llama, qwen3, qwen3_moe  # noqa: F401
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)
from mlx_lm.models.cache import make_prompt_cache as lm_make_prompt_cache
from mlx_vlm.models import base as vlm_base
from mlx_vlm.turboquant import BatchTurboQuantKVCache as VlmBatchTurboQuantKVCache
from mlx_vlm.turboquant import TurboQuantKVCache

import tqbatch.mlx_lm as tq_mlx_lm
from tqbatch import BatchableTurboQuantKVCache, BatchTurboQuantKVCache
from tqbatch.workbench import lm_families
from tqbatch.workbench.e2e import LOGITS_ATOL

from .support import drain

BITS, SEED = 4.0, 0
ORIGINAL = lm_base.scaled_dot_product_attention
assert ORIGINAL.__module__ == "mlx_lm.models.base", "a route was left enabled at import"

# BatchGenerator can be neither teacher-forced nor tapped, so logprobs are
# compared with the requests run alone at LOGITS_ATOL: the rows hold the same
# packed codes, and only float32 summation order (batch of 3 vs 1, prompt
# prefilled in one chunk vs BatchGenerator's prompt[:-1] + last token)
# separates them, ~1e-6 here. It holds at float32 only: at TF32 a forward-noise
# code flip moves logits by up to 1e-1 with a correct cache.
tf32 = pytest.mark.float32_only(
    reason="logprobs vs alone at 1e-4 need float32 matmuls (as test_batch_generator.py)",
)

# The matrix's mlx-lm families (tqbatch.workbench.lm_families), plus lfm2: a
# convolution layer whose ArraysCache the factory must leave alone.
LFM2 = dict(  # layer 0 a short convolution (ArraysCache), layer 1 attention
    num_attention_heads=2,  # no head_dim field: hidden / heads = 32
    num_key_value_heads=1,
    head_dim=None,
    rms_norm_eps=None,
    norm_eps=1e-6,
    max_position_embeddings=512,
    conv_bias=False,
    conv_L_cache=3,
    block_dim=64,
    block_multiple_of=32,
    block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=False,
    intermediate_size=128,
    layer_types=["conv", "full_attention"],
)
FAMILIES = ["llama", "qwen3", "gemma3_text", "gpt_oss", "qwen3_moe", "lfm2"]
TQ = BatchableTurboQuantKVCache
# The factory's per-layer caches: the model's own, its plain KVCaches made TurboQuant.
LAYERS = {
    "gemma3_text": [RotatingKVCache, TQ],  # sliding-window layers stay rotating
    "gpt_oss": [RotatingKVCache, TQ],
    "lfm2": [ArraysCache, TQ],  # convolution state stays as the model made it
}

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [100, 200, 30, 40, 5, 6, 7, 8, 9, 10, 11]]
MAX_TOKENS = [8, 6, 5]  # all three in one batch for a step or two


def build(family: str, seed: int = 0) -> nn.Module:
    """The family's tiny mlx-lm model with seeded random float32 weights (lm_families')."""
    if family == "lfm2":
        return lm_families.build_model("lfm2", LFM2, seed)
    return lm_families.SPECS[lm_families.PREFIX + family].build(seed)


@pytest.fixture(scope="module")
def models():
    built = {}

    def get(family):
        if family not in built:
            built[family] = build(family)
        return built[family]

    return get


@pytest.fixture
def route():
    """The route enabled for the test; whatever the test does, disabled after."""
    tq_mlx_lm.enable()
    yield
    tq_mlx_lm.disable()
    assert lm_base.scaled_dot_product_attention is ORIGINAL


def _holders(fn) -> set[str]:
    return {
        name
        for name, module in list(sys.modules.items())
        if isinstance(getattr(module, "__dict__", None), dict)
        and vars(module).get("scaled_dot_product_attention") is fn
    }


def _batch_caches(n_layers: int) -> list:
    return [BatchTurboQuantKVCache([0, 1], bits=BITS, seed=SEED) for _ in range(n_layers)]


TOKENS = mx.array([[1, 2, 3, 4], [0, 5, 6, 7]])


@pytest.fixture
def vlm_calls(monkeypatch):
    """(cache, its rows then) of every call to mlx-vlm's attention, where the route sends
    TurboQuant caches."""
    calls = []
    inner = vlm_base.scaled_dot_product_attention

    def recording(queries, keys, values, cache, *args, **kwargs):
        calls.append((cache, getattr(cache, "batch_size", 1)))
        return inner(queries, keys, values, cache, *args, **kwargs)

    monkeypatch.setattr(vlm_base, "scaled_dot_product_attention", recording)
    return calls


# ---------------------------------------------------------------- (a) the crash, and the route


def test_without_the_route_mlx_lm_attention_fails_on_a_tqbatch_cache(models):
    """Upstream: mlx-lm sends any cache with ``bits`` down its affine-quantized attention."""
    assert not tq_mlx_lm.is_enabled()
    with pytest.raises(AttributeError, match="group_size"):
        models("llama")(TOKENS, cache=_batch_caches(2))


@pytest.mark.parametrize(
    "batch_class", [BatchTurboQuantKVCache, VlmBatchTurboQuantKVCache], ids=["tqbatch", "mlx_vlm"]
)
def test_with_the_route_mlx_lm_attention_runs_on_a_turboquant_batch(models, route, batch_class):
    model = models("llama")
    caches = [batch_class([0, 1], bits=BITS, seed=SEED) for _ in range(2)]
    logits = model(TOKENS, cache=caches)
    logits = model(mx.array([[8], [9]]), cache=caches)
    assert logits.shape == (2, 1, 256) and bool(mx.isfinite(logits).all())
    assert caches[0].offset.tolist() == [5, 4]


# ---------------------------------------------------------------- (b) other caches untouched


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: [KVCache() for _ in range(2)], id="KVCache"),
        pytest.param(lambda: [BatchKVCache([0, 1]) for _ in range(2)], id="BatchKVCache"),
        pytest.param(
            lambda: [QuantizedKVCache(group_size=32, bits=4) for _ in range(2)],
            id="QuantizedKVCache",
        ),
    ],
)
def test_the_route_changes_nothing_for_other_caches(models, make, vlm_calls):
    model = models("llama")
    tokens = TOKENS if isinstance(make()[0], BatchKVCache) else TOKENS[:1]

    def run():
        caches = make()
        prefill = model(tokens, cache=caches)
        decode = model(tokens[:, -1:], cache=caches)
        return prefill, decode

    plain = run()
    with tq_mlx_lm.routed():
        assert llama.scaled_dot_product_attention is not ORIGINAL  # really routed
        routed = run()
    assert vlm_calls == []  # mlx-lm's original served them, not mlx-vlm's look-alike
    for a, b in zip(plain, routed):
        assert mx.array_equal(a, b)  # bit for bit


# ---------------------------------------------------------------- (c) BatchGenerator


def _reference_caches(model) -> list:
    """One request's caches: mlx-vlm's plain ``TurboQuantKVCache`` for each plain KVCache."""
    return [
        TurboQuantKVCache(bits=BITS, seed=SEED) if type(c) is KVCache else c
        for c in lm_make_prompt_cache(model)
    ]


def _alone(model, prompt, steps):
    """Greedy tokens and log-softmax rows of ``prompt`` decoded alone."""
    caches = _reference_caches(model)
    logits = model(mx.array([prompt]), cache=caches)[0, -1]
    tokens, logprobs = [], []
    while True:
        logprobs.append(logits - mx.logsumexp(logits))
        tokens.append(int(mx.argmax(logits).item()))
        if len(tokens) == steps:
            return tokens, logprobs
        logits = model(mx.array([[tokens[-1]]]), cache=caches)[0, -1]


@tf32
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_generator_on_mlx_lm_models_equals_requests_alone(family, models, route, vlm_calls):
    model = models(family)
    layer_types = [type(c) for c in tq_mlx_lm.make_prompt_cache(model, bits=BITS, seed=SEED)]
    assert layer_types == LAYERS.get(family, [TQ, TQ])

    def caches(n):
        return [tq_mlx_lm.make_prompt_cache(model, bits=BITS, seed=SEED) for _ in range(n)]

    gen = BatchGenerator(model, max_tokens=8, prefill_batch_size=2, completion_batch_size=3)
    gen.insert(PROMPTS[:2], max_tokens=MAX_TOKENS[:2], caches=caches(2))
    tokens, logprobs, finished = drain(
        gen, late=lambda: gen.insert(PROMPTS[2:], max_tokens=MAX_TOKENS[2:], caches=caches(1))
    )

    rows = [n for c, n in vlm_calls if isinstance(c, BatchTurboQuantKVCache)]
    assert max(rows) == 3  # batched attention, the late request included
    assert sorted(tokens) == [0, 1, 2]
    worst = 0.0
    for uid, prompt in enumerate(PROMPTS):
        alone_tokens, alone_logprobs = _alone(model, prompt, MAX_TOKENS[uid])
        assert tokens[uid] == alone_tokens
        for mine, alone in zip(logprobs[uid], alone_logprobs):
            worst = max(worst, mx.abs(mine - alone).max().item())
        # extract() gives back single-request caches BatchGenerator can merge again.
        assert [type(c) for c in finished[uid]] == layer_types
    print(f"{family}: max |logprob batched - alone| = {worst:.2e}")
    assert worst <= LOGITS_ATOL


@tf32
def test_install_make_cache_is_the_hook_batch_generator_and_the_server_call(models, route):
    """Requests inserted without caches get ``model.make_cache()``: the factory's caches."""
    model = build("gemma3_text")  # its own make_cache: the installed one must not call itself
    tq_mlx_lm.install_make_cache(model, bits=BITS, seed=SEED)
    tq_mlx_lm.install_make_cache(model, bits=BITS, seed=SEED)  # again: replaces, no recursion
    made = lm_make_prompt_cache(model)  # what mlx_lm.server and BatchGenerator.insert call
    assert [type(c) for c in made] == [RotatingKVCache, BatchableTurboQuantKVCache]
    assert all(hasattr(c, "merge") for c in made)  # mlx_lm.server's is_batchable

    gen = BatchGenerator(model, max_tokens=3, prefill_batch_size=2, completion_batch_size=2)
    gen.insert(PROMPTS[:2], max_tokens=[3, 3])
    tokens, _, finished = drain(gen)
    for uid in range(2):
        assert tokens[uid] == _alone(model, PROMPTS[uid], 3)[0]
        assert isinstance(finished[uid][1], BatchableTurboQuantKVCache)


def _readme_example() -> str:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("### With mlx-lm's `BatchGenerator`") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@tf32
def test_readme_server_example_runs(models):
    """The README's BatchGenerator block, verbatim, on a tiny llama and two prompts."""
    model, prompts = models("llama"), PROMPTS[:2]
    namespace = {"model": model, "prompts": prompts}
    try:
        exec(compile(_readme_example(), "README BatchGenerator example", "exec"), namespace)
        assert tq_mlx_lm.is_enabled()
        for uid, prompt in zip(namespace["uids"], prompts):
            assert namespace["tokens"][uid] == _alone(model, prompt, 8)[0]
    finally:
        tq_mlx_lm.disable()


def test_factory_keeps_dense_layers_and_passes_configuration(models):
    model = models("llama")
    caches = tq_mlx_lm.make_prompt_cache(model, bits=3, key_bits=4, seed=7, dense_layers=[1])
    assert type(caches[1]) is KVCache
    assert isinstance(caches[0], BatchableTurboQuantKVCache)
    assert (caches[0].bits, caches[0].key_bits, caches[0].seed) == (3, 4, 7)


# ---------------------------------------------------------------- (d) enable / disable restore


def _not_yet_imported_family() -> str:
    for family in ("starcoder2", "olmo2", "stablelm", "phi3", "granite", "helium", "exaone"):
        if f"mlx_lm.models.{family}" not in sys.modules:
            return f"mlx_lm.models.{family}"
    pytest.skip("every candidate mlx-lm family is already imported")


def test_enable_disable_and_routed_restore_every_module():
    before = _holders(ORIGINAL)
    assert {"mlx_lm.models.base", "mlx_lm.models.llama", "mlx_lm.models.gpt_oss"} <= before
    late = _not_yet_imported_family()
    try:
        tq_mlx_lm.enable()
        tq_mlx_lm.enable()  # idempotent
        assert tq_mlx_lm.is_enabled()
        assert _holders(ORIGINAL) == set()
        importlib.import_module(late)  # takes the route from base
        assert _holders(tq_mlx_lm._route) == before | {late}
    finally:
        tq_mlx_lm.disable()  # one disable undoes two enables
    assert not tq_mlx_lm.is_enabled()
    assert _holders(tq_mlx_lm._route) == set()
    assert _holders(ORIGINAL) == before | {late}
    tq_mlx_lm.disable()  # idempotent
    assert _holders(ORIGINAL) == before | {late}


def test_routed_nests_and_restores_on_error():
    with tq_mlx_lm.routed():
        with tq_mlx_lm.routed():
            assert llama.scaled_dot_product_attention is tq_mlx_lm._route
        assert tq_mlx_lm.is_enabled()  # the inner block found it enabled and left it so
    assert llama.scaled_dot_product_attention is ORIGINAL

    tq_mlx_lm.enable()
    try:
        with tq_mlx_lm.routed():
            pass
        assert tq_mlx_lm.is_enabled()
    finally:
        tq_mlx_lm.disable()

    with pytest.raises(RuntimeError), tq_mlx_lm.routed():
        raise RuntimeError
    assert _holders(tq_mlx_lm._route) == set()


def test_importing_tqbatch_patches_nothing():
    """In a fresh interpreter: importing tqbatch and tqbatch.mlx_lm leaves mlx-lm as it was."""
    script = textwrap.dedent(
        """
        import mlx_lm.models.base as base
        import mlx_lm.models.llama as llama
        original = base.scaled_dot_product_attention
        import tqbatch, tqbatch.mlx_lm
        import mlx_lm.models.qwen3 as qwen3
        assert original.__module__ == "mlx_lm.models.base", original.__module__
        assert base.scaled_dot_product_attention is original
        assert llama.scaled_dot_product_attention is original
        assert qwen3.scaled_dot_product_attention is original
        assert not tqbatch.mlx_lm.is_enabled()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
