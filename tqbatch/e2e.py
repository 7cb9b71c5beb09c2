"""End to end: continuous batching through a real mlx-vlm language model.

Builds a small Qwen2 language model from mlx-vlm's own model code
(``mlx_vlm.models.qwen2.language.Model``) with random weights made locally,
drives it with :class:`tqbatch.serving.ContinuousBatcher` through every batch
operation a server uses, and checks each request against the same request
decoded alone with one single-request ``TurboQuantKVCache`` per layer (and a
``KVCache`` for the dense last layer).

Why this model: its attention calls ``mlx_vlm.models.base.
scaled_dot_product_attention`` (the only SDPA that understands TurboQuant
states), applies RoPE with ``offset=cache.offset`` through ``nn.RoPE``, whose
``mx.fast.rope`` accepts a per-row ``(B,)`` offset array, and builds one mask
per forward from ``cache[0]``, reused by all layers, as servers do.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_vlm.models.qwen2 import language as qwen2_language
from mlx_vlm.models.qwen2.config import ModelConfig
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.serving import ContinuousBatcher, Request

__all__ = [
    "LOGITS_ATOL",
    "ModelSpec",
    "ReferenceRun",
    "ScenarioReferences",
    "ScenarioResult",
    "build_model",
    "reference_run",
    "run_scenario",
    "scenario_references",
]

# Batched and single-request logits may differ only by float32 summation
# order: batched matmuls, softmax over masked padding columns, the masked
# chunked TurboQuant decode path against the unmasked single-request one, a
# verify block against token-by-token decode. Rows hold the same packed codes,
# so nothing quantization-sized is allowed. Measured max over the scenario:
# ~4e-6 on logits of std ~1 (see the report printed by `tqbatch e2e`); 1e-4
# leaves 25x headroom, while one row attending a single stale or padding slot,
# or one token's codes shifted by a slot, moves logits by 1e-3 .. 1e-1.
LOGITS_ATOL = 1e-4


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of the locally made Qwen2 language model (head_dim = hidden / heads)."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def describe(self) -> str:
        return (
            f"mlx_vlm qwen2 language model: {self.num_layers} layers, hidden {self.hidden_size}, "
            f"{self.num_heads} query / {self.num_kv_heads} KV heads, head_dim {self.head_dim}, "
            f"MLP {self.intermediate_size}, vocab {self.vocab_size}, weight seed {self.seed}"
        )


def build_model(spec: ModelSpec = ModelSpec()) -> qwen2_language.Model:
    """A float32 Qwen2 language model from mlx-vlm's code with seeded random weights.

    Linear weights are normal(0, 1/fan_in) and biases normal(0, 0.1): unlike
    MLX's default init, this gives a model whose greedy output does not
    collapse onto one repeated token, so decode steps differ from each other.
    """
    config = ModelConfig(
        model_type="qwen2",
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        rms_norm_eps=1e-6,
        vocab_size=spec.vocab_size,
        num_key_value_heads=spec.num_kv_heads,
        tie_word_embeddings=True,
    )
    model = qwen2_language.Model(config)
    weights = []
    for i, (name, param) in enumerate(sorted(tree_flatten(model.parameters()))):
        key = mx.random.key(spec.seed * 1_000_003 + i)
        if "norm" in name:
            weights.append((name, param))  # RMSNorm scales stay at 1
        elif "embed_tokens" in name:
            weights.append((name, mx.random.normal(param.shape, key=key) * spec.hidden_size**-0.5))
        elif name.endswith("bias"):
            weights.append((name, mx.random.normal(param.shape, key=key) * 0.1))
        else:
            weights.append((name, mx.random.normal(param.shape, key=key) * param.shape[-1] ** -0.5))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


@dataclass
class ReferenceRun:
    """One request decoded alone: ``logits[j]`` produced ``tokens[j]``."""

    tokens: list[int]
    logits: list[mx.array]
    caches: list

    def min_margin(self, steps: int) -> float:
        """Smallest top-1 minus top-2 logit gap over the first ``steps`` tokens."""
        gaps = []
        for row in self.logits[:steps]:
            top2 = np.sort(np.array(row))[-2:]
            gaps.append(float(top2[1] - top2[0]))
        return min(gaps)


def reference_run(
    model,
    prompt: Sequence[int],
    steps: int,
    *,
    bits: float,
    seed: int,
    dense_layers: Sequence[int],
) -> ReferenceRun:
    """Greedy-decode ``prompt`` alone, one ``TurboQuantKVCache`` per layer.

    Produces ``steps`` logits rows (the prefill's and ``steps - 1`` decodes).
    """
    caches = [
        KVCache() if i in dense_layers else TurboQuantKVCache(bits=bits, seed=seed)
        for i in range(len(model.layers))
    ]
    logits = model(mx.array([list(prompt)]), cache=caches)[0, -1].astype(mx.float32)
    rows, tokens = [], []
    while True:
        mx.eval(logits)
        rows.append(logits)
        tokens.append(int(mx.argmax(logits).item()))
        if len(rows) == steps:
            return ReferenceRun(tokens, rows, caches)
        logits = model(mx.array([[tokens[-1]]]), cache=caches)[0, -1].astype(mx.float32)


# The scenario: (uid, prompt length, max new tokens). Prompt tokens are drawn
# from the scenario seed. B stays <= 4 at all times (CPU budget).
REQUESTS = (
    ("A", 7, 13),
    ("B", 3, 11),
    ("C", 11, 3),  # longest prompt leaves first: filter must compact its padding
    ("D", 4, 9),
    ("E", 9, 8),
    ("F", 5, 6),
    ("G", 8, 5),
)
# Where the oracle draft model deliberately errs, per request (index into the
# drafts; >= block-1 means it never errs), so that rows accept different
# numbers of drafts and the common rollback trims something.
DRAFT_ERRORS = {"A": 3, "B": 1, "C": 2, "D": 2, "E": 1, "F": 3, "G": 2}


@dataclass
class ScenarioResult:
    """What the scenario did and how far each request is from its reference."""

    spec: ModelSpec
    bits: float
    events: list[str] = field(default_factory=list)
    max_logit_diff: dict[str, float] = field(default_factory=dict)
    tokens_match: dict[str, bool] = field(default_factory=dict)
    resume_diff: dict[str, float] = field(default_factory=dict)
    extracted_lengths_ok: dict[str, bool] = field(default_factory=dict)
    code_mismatches: dict[str, list[int]] = field(default_factory=dict)
    min_reference_margin: float = float("inf")
    mask_checks: int = 0
    forwards: int = 0
    trimmed: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def worst_diff(self) -> float:
        return max(self.max_logit_diff.values(), default=0.0)

    def failures(self, atol: float = LOGITS_ATOL) -> list[str]:
        """Every violated check, as a sentence; empty when the run is good."""
        out = []
        for uid, diff in self.max_logit_diff.items():
            if not self.tokens_match[uid]:
                out.append(f"request {uid}: greedy tokens differ from the request run alone")
            if not diff <= atol:
                out.append(f"request {uid}: logits differ by {diff:.3g} > {atol:g}")
            if not self.extracted_lengths_ok[uid]:
                out.append(f"request {uid}: extracted caches hold the wrong number of tokens")
            if not self.resume_diff[uid] <= atol:
                out.append(
                    f"request {uid}: decoding on from its extracted caches differs by "
                    f"{self.resume_diff[uid]:.3g} > {atol:g}"
                )
        if self.min_reference_margin <= 2 * atol:
            out.append(
                f"the reference has a near-tie (top-2 gap {self.min_reference_margin:.3g}): "
                "greedy tokens could flip on rounding alone; choose another model seed"
            )
        if self.mask_checks == 0:
            out.append("no array mask was ever checked against the caches")
        if self.trimmed == 0:
            out.append("speculative verification never rolled anything back")
        return out


def _oracle_proposer(references: dict[str, ReferenceRun], vocab: int, errors: dict[str, int]):
    """A draft model that knows each request's true continuation but errs on cue."""

    def propose(request: Request, n: int) -> list[int]:
        start = len(request.tokens)  # the pending token is tokens[-1]
        truth = references[request.uid].tokens
        drafts = [truth[start + i] if start + i < len(truth) else 0 for i in range(n)]
        at = errors.get(request.uid, n)
        if at < n:
            drafts[at] = (drafts[at] + 1) % vocab
        return drafts

    return propose


@dataclass
class ScenarioReferences:
    """The scenario's prompts and every request decoded alone."""

    prompts: dict[str, list[int]]
    budget: dict[str, int]
    runs: dict[str, ReferenceRun]
    seconds: float


def scenario_references(
    model, spec: ModelSpec, *, bits: float = 4.0, seed: int = 0, prompt_seed: int = 0
) -> ScenarioReferences:
    """Draw the scenario's prompts and decode each request alone.

    One step more than each budget: a finished request is resumed from its
    extracted caches for one step and compared with that extra row.
    """
    clock = time.perf_counter()
    rng = np.random.default_rng(prompt_seed)
    prompts = {
        uid: [int(t) for t in rng.integers(1, spec.vocab_size, size=n)] for uid, n, _ in REQUESTS
    }
    budget = {uid: m for uid, _, m in REQUESTS}
    runs = {
        uid: reference_run(
            model,
            prompts[uid],
            budget[uid] + 1,
            bits=bits,
            seed=seed,
            dense_layers=[spec.num_layers - 1],
        )
        for uid in prompts
    }
    return ScenarioReferences(prompts, budget, runs, time.perf_counter() - clock)


def run_scenario(
    spec: ModelSpec = ModelSpec(),
    *,
    bits: float = 4.0,
    seed: int = 0,
    prompt_seed: int = 0,
    batch_cache_class: type | None = None,
    model=None,
    references: ScenarioReferences | None = None,
) -> ScenarioResult:
    """Run the server-like scenario and compare every request with its reference.

    ``model`` and ``references`` may be passed in to share them between runs
    (they must come from the same ``spec``, bits, seed and prompt seed).
    Raises whatever the cache raises (a broken cache may crash the model), and
    ``tqbatch.serving.MaskGeometryError`` when a layer disagrees with the mask.
    """
    result = ScenarioResult(spec=spec, bits=bits)
    clock = time.perf_counter()
    model = model if model is not None else build_model(spec)
    result.seconds["build model"] = time.perf_counter() - clock

    if references is None:
        references = scenario_references(model, spec, bits=bits, seed=seed, prompt_seed=prompt_seed)
    result.seconds["references (alone)"] = references.seconds
    prompts, budget = references.prompts, references.budget
    dense = [spec.num_layers - 1]
    result.min_reference_margin = min(
        ref.min_margin(budget[uid] + 1) for uid, ref in references.runs.items()
    )

    kwargs = {} if batch_cache_class is None else {"batch_cache_class": batch_cache_class}
    server = ContinuousBatcher(model, bits=bits, seed=seed, dense_layers=dense, **kwargs)
    requests = {uid: Request(uid, prompts[uid], budget[uid]) for uid in prompts}
    propose = _oracle_proposer(references.runs, spec.vocab_size, DRAFT_ERRORS)

    def log(event: str):
        rows = ",".join(r.uid for r in server.active) or "-"
        result.events.append(f"{event:<44} batch [{rows}]")

    clock = time.perf_counter()
    try:
        server.admit_left_padded([requests[u] for u in "ABC"])
        log("prefill A,B,C left-padded (constructor)")
        for _ in range(2):
            server.step()
            log("decode")  # C reaches its budget: extract + filter
        server.admit_right_padded([requests[u] for u in "DE"])
        log("late join D,E: right-padded prefill, extend")
        server.step()
        log("decode")
        accepted = server.verify(propose, block=4)
        log(f"verify 4-token block: {accepted} drafts kept, trim")
        server.step()
        log("decode")
        accepted = server.verify(propose, block=3)
        log(f"verify 3-token block: {accepted} drafts kept, trim")
        while len(server.active) > 2:
            server.step()
            log("decode")
        server.admit_merged([requests[u] for u in "FG"])
        log("late join F,G: prefilled alone, merge, extend")
        accepted = server.verify(propose, block=4)
        log(f"verify 4-token block: {accepted} drafts kept, trim")
        while server.active:
            server.step()
            log("decode")
    finally:
        result.seconds["scenario (batched)"] = time.perf_counter() - clock
        result.forwards = server.forwards
        result.trimmed = server.trimmed
        result.mask_checks = server.probe.checks
        server.probe.remove()

    clock = time.perf_counter()
    for uid, req in requests.items():
        ref = references.runs[uid]
        n = req.max_new_tokens
        result.tokens_match[uid] = req.tokens == ref.tokens[:n]
        diffs = [float(mx.abs(a - b).max()) for a, b in zip(req.logits, ref.logits[:n])]
        result.max_logit_diff[uid] = max(diffs) if len(diffs) == n else float("inf")

        finished = server.finished[uid]
        held = len(req.prompt) + n - 1  # the last generated token is still pending
        result.extracted_lengths_ok[uid] = all(int(c.offset) == held for c in finished.caches)
        result.code_mismatches[uid] = _code_mismatches(finished.caches, ref.caches, held)
        # Decode one more step from the extracted single-request caches.
        resumed = model(mx.array([[req.tokens[-1]]]), cache=finished.caches)[0, -1]
        result.resume_diff[uid] = float(mx.abs(resumed.astype(mx.float32) - ref.logits[n]).max())
    result.seconds["checks"] = time.perf_counter() - clock
    return result


def _code_mismatches(extracted: list, reference: list, held: int) -> list[int]:
    """Per quantized layer, how many packed key/value words differ from the reference.

    A diagnostic, not a check: layer 0's inputs are the same embeddings either
    way, but deeper layers see hidden states that differ in the last float32
    bits, which can tip a coordinate across a codebook boundary.
    """
    counts = []
    for mine, theirs in zip(extracted, reference):
        if not isinstance(theirs, TurboQuantKVCache) or mine.keys is None:
            continue
        n = 0
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            for (_, x), (_, y) in zip(tree_flatten(a), tree_flatten(b)):
                x, y = np.array(x[:, :, :held]), np.array(y[:, :, :held])
                n += int(np.sum(x != y)) if x.shape == y.shape else x.size
        counts.append(n)
    return counts
