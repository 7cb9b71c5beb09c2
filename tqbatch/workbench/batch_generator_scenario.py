"""The matrix's ``batch_generator`` scenario: mlx-lm's own ``BatchGenerator`` under the oracle.

mlx-lm's serving loop, not the matrix's: requests are inserted with their
per-request caches (mlx-lm's rule, ``tqbatch.mlx_lm.make_prompt_cache`` for a
quantized target), prefilled right-padded (``prepare``/``finalize``), merged
into the running batch (``extend``), decoded greedily, removed mid-flight
(``remove(..., return_prompt_caches=True)``) or finished (``extract`` +
``filter``), and a finished request's extracted caches are inserted again
(``insert(..., caches=[...])``) to go on where it stopped: prompt-cache reuse.

``BatchGenerator`` cannot be teacher-forced, but its greedy tokens are the
request's alone tokens while the batch is right. Its two model calls
(``PromptProcessingBatch.prompt`` and ``GenerationBatch._step``) are wrapped
for the run so that each is one forward under the matrix's oracle: every write
to a target layer feeds the request's reference, every attention call on it
and every row afterwards is checked (``model_matrix.Oracle``), and so is every
cache handed back. Each token must be the request's alone token, and its
logprobs within ``MODEL_GAP_LIMIT`` of the alone run's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models import cache as lm_cache
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch import mlx_lm as tq_mlx_lm
from tqbatch.cache import BatchTurboQuantKVCache
from tqbatch.testing.oracles.reference import to_numpy
from tqbatch.workbench.serving import ForwardLayout
from tqbatch.workbench.serving_oracle import CacheCheckFailed

__all__ = ["MAX_TOKENS", "run"]

# Tokens per request: A finishes first and is reinserted for REUSE more after a
# one-token follow-up prompt (A's teacher covers 5 + 1 + 4 <= STEPS); B is removed
# mid-flight; C and D run to the end.
MAX_TOKENS = {"A": 5, "B": 6, "C": 9, "D": 6}
REUSE = 4
LATE_STEP = 2  # B and D join after this many decode steps of A and C
REMOVE_STEP = 5  # B is removed after this many


def run(adapter, requests, *, bits: float, seed: int) -> None:
    """Drive ``adapter.model`` (a ``model_matrix.MatrixAdapter``) through mlx-lm's
    ``BatchGenerator`` under ``adapter.oracle``; raises ``CacheCheckFailed``.

    ``requests`` are teacher-forced ``serving.Request``s: each token taken is
    appended to the request's ``tokens``; ``bits`` and ``seed`` configure every
    request's TurboQuant caches (the matrix's ``BITS`` and ``SEED``)."""
    model, target, oracle = adapter.model, adapter.target, adapter.oracle
    keys: dict[int, str] = {}  # BatchGenerator's uid -> the matrix request

    def fresh_caches():
        if not target.quantized:
            return lm_cache.make_prompt_cache(model)
        return tq_mlx_lm.make_prompt_cache(model, bits=bits, seed=seed, batch_class=target.cls)

    def reusable(caches):
        # tqbatch's extract gives caches that merge into tqbatch's class; for any
        # other target class a server would hand them back as that class's singles.
        if target.cls in (None, BatchTurboQuantKVCache):
            return caches
        single = tq_mlx_lm.batchable_class(target.cls)
        return [single.from_single(c) if isinstance(c, TurboQuantKVCache) else c for c in caches]

    gen = BatchGenerator(model, max_tokens=16, prefill_batch_size=2, completion_batch_size=4)

    def insert(key, prompt, max_tokens, caches, all_tokens):
        (uid,) = gen.insert([prompt], [max_tokens], caches=[caches], all_tokens=[all_tokens])
        keys[uid] = key

    def forward(part, real, kind: str, settled: str, call):
        """``call()``, one forward of ``part``'s rows under the oracle, then its rows settled."""
        adapter.note_layers(part.prompt_cache)
        uids = tuple(keys[u] for u in part.uids)
        with oracle.forward(ForwardLayout(kind, uids, tuple(real)), part.prompt_cache):
            result = call()
        oracle.settled(uids, part.prompt_cache, settled)
        return result

    original_prompt, original_step = PromptProcessingBatch.prompt, GenerationBatch._step

    def prompt(part, tokens):
        if not part.uids or not tokens:  # mlx-lm returns at once: no forward
            return original_prompt(part, tokens)
        # Right-padded: row b's real columns are its first len(tokens[b]).
        real = [range(0, len(t)) for t in tokens]
        forward(part, real, "prompt", "prompt (finalized)", lambda: original_prompt(part, tokens))

    def step(part):
        real = [range(0, 1)] * len(part.uids)
        return forward(part, real, "decode", "decode", lambda: original_step(part))

    def take(r):
        """Check one response against the request alone; the caches it hands back too."""
        key = keys[r.uid]
        req = requests[key]
        n = len(req.tokens)
        if n >= len(req.teacher):
            raise CacheCheckFailed(f"{key} got a token past its {len(req.teacher)} alone ones")
        if r.token != req.teacher[n]:
            raise CacheCheckFailed(f"{key}'s token {n} is {r.token}, alone {req.teacher[n]}")
        alone = req.alone[n]
        alone = alone - np.log(np.sum(np.exp(alone - alone.max()))) - alone.max()
        logprobs = to_numpy(r.logprobs.astype(mx.float32))
        req.gaps.append(float(np.abs(logprobs - alone).max()))
        req.tokens.append(r.token)
        if r.finish_reason is not None:
            oracle.extracted(key, r.prompt_cache, f"cache {key} finished with")
        return key

    PromptProcessingBatch.prompt, GenerationBatch._step = prompt, step
    try:
        for key in ("A", "C"):
            insert(key, requests[key].prompt, MAX_TOKENS[key], fresh_caches(), [])
        steps, reused = 0, False
        while responses := gen.next_generated():
            steps += 1
            for r in responses:
                key = take(r)
                if key == "A" and r.finish_reason is not None and not reused:
                    reused = True
                    # BatchGenerator has already fed the last token it returned (it
                    # computes one step ahead): the caches hold it. The follow-up
                    # prompt is the token the request would have produced next.
                    a = requests["A"]
                    follow_up = a.teacher[len(a.tokens)]
                    a.tokens.append(follow_up)
                    tokens = list(r.all_tokens)
                    insert("A", [follow_up], REUSE, reusable(r.prompt_cache), tokens)
            if steps == LATE_STEP:
                for key in ("B", "D"):
                    insert(key, requests[key].prompt, MAX_TOKENS[key], fresh_caches(), [])
            if steps == REMOVE_STEP:
                (uid,) = [u for u, k in keys.items() if k == "B"]
                removed = gen.remove([uid], return_prompt_caches=True)
                if uid not in removed:
                    raise CacheCheckFailed(f"remove of B at step {steps}: no caches handed back")
                oracle.extracted("B", removed[uid][0], "cache B was removed with")
    finally:
        PromptProcessingBatch.prompt, GenerationBatch._step = original_prompt, original_step
    done = {k: len(requests[k].tokens) for k in MAX_TOKENS}
    want = {k: n + (1 + REUSE if k == "A" else 0) for k, n in MAX_TOKENS.items()}
    want["B"] = done["B"]  # removed mid-flight: however far it got
    if done != want or not reused or done["B"] >= MAX_TOKENS["B"]:
        raise CacheCheckFailed(f"BatchGenerator gave {done} tokens per request, expected {want}")
