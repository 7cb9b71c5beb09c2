"""``attend``: a forward step as a model layer performs it (mask, write, attend)."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from mlx_vlm.models.base import scaled_dot_product_attention

from tqbatch.testing.contract import strategies as tqs
from tqbatch.testing.contract.checks import CONTRACT, Check
from tqbatch.testing.contract.ops.declaration import Op, Recorded, Rule
from tqbatch.testing.oracles.generation import random_kv
from tqbatch.testing.oracles.judges import judge
from tqbatch.testing.oracles.numpy_model import attention, causal_mask
from tqbatch.testing.oracles.reference import to_numpy
from tqbatch.testing.oracles.tolerances import CROSS_PLATFORM_NOTE, attention_tolerance

# Query heads per KV head. Built once: Hypothesis analyses every new strategy object.
_GQA_GROUPS = st.sampled_from([1, 2])


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
@st.composite
def attend_op(draw, kv_heads: int, max_queries: int = tqs.MAX_BLOCK):
    """A forward step: N queries (GQA: q_heads a multiple of kv_heads), N new tokens."""
    n = draw(st.integers(1, max_queries))
    op = {
        "op": "attend",
        "queries": n,
        "q_heads": kv_heads * draw(_GQA_GROUPS),
        "q_seed": draw(tqs.seeds),
        "kv_seed": draw(tqs.seeds),
    }
    if draw(st.integers(0, 3)) == 0:
        op["window_size"] = draw(st.integers(1, 6))
    return op


def _target(world, op):
    N, Hq = int(op["queries"]), int(op["q_heads"])
    window = op.get("window_size")
    B, D = world.numpy_model.batch_size, world.head_dim
    rng = np.random.default_rng(op["q_seed"])
    queries = rng.standard_normal((B, Hq, N, D)).astype(np.float32)
    padded = world.numpy_model.padding_slots(N)
    kv_seed = op.get("kv_seed", op["q_seed"] + 1)
    keys, values = random_kv(kv_seed, (B, world.kv_heads, N, D), op.get("scale", 1.0), padded)
    mask = world.target.make_mask(N, return_array=True, window_size=window)
    ks, vs = world.target.update_and_fetch(mx.array(keys), mx.array(values))
    out = scaled_dot_product_attention(
        mx.array(queries), ks, vs, cache=world.target, scale=D**-0.5, mask=mask
    )
    return queries, keys, values, to_numpy(out), padded


def _oracles(world, op, ctx):
    queries, keys, values, out, padded = ctx
    window, D = op.get("window_size"), world.head_dim
    end_before = world.numpy_model.end
    taken = world.write_oracles(keys, values)
    for b, row in enumerate(world.numpy_model.rows):
        valid = taken[b]
        n_valid = valid.stop - valid.start
        if n_valid == 0:
            continue  # every query of this row is padding: its output is unused
        rid = row.request.id
        q = queries[b][:, valid]

        def operands(rid=rid, q=q, got=out[b, :, valid], n_valid=n_valid):
            # Exact (float64) attention over the codes a request alone holds.
            # The bound is for two float32 routes (twice one route's), so it
            # also covers one route against the exact value.
            ref_k, ref_v = world.refs.dequantized(rid)
            mask = causal_mask(n_valid, ref_k.shape[1] - n_valid, [0], window)[0, 0]
            want = attention(q, ref_k, ref_v, mask, D**-0.5)
            return got, want, attention_tolerance(q, ref_k, ref_v, mask, D**-0.5)

        # Where it differs: the row may hold another code or norm rounding allows.
        judgement = judge(operands, lambda b=b: world.admit_row(b))
        if not judgement.passed:
            world.report(
                "attention",
                op,
                f"attention of row {b} (request {rid}, {n_valid} valid queries) differs from "
                f"exact attention over the per-request TurboQuant reference {judgement.detail()}",
            )
    return {"attention": out, "end_before": end_before, "padded": padded}


def _observe(target, op, result):
    out = np.array(result["attention"], dtype=np.float32)
    # Outputs of padding queries are unspecified: NaN marks them unrecorded.
    out = np.where(result["padded"][:, None, :, None], np.float32(np.nan), out)
    return {"attention": out}


def _decode(machine, data):
    """One token per row (T = 1), with attention."""
    return [data.draw(attend_op(machine.world.kv_heads, max_queries=1), label="decode")]


OP = Op(
    name="attend",
    fields="`queries: int`, `q_heads: int`, `q_seed: int`",
    meaning="a forward step: `mask = target.make_mask(queries, return_array=True)`, then "
    "`update_and_fetch` of `queries` new tokens per row, then attention of `(B, q_heads, "
    "queries, D)` queries through `mlx_vlm.models.base.scaled_dot_product_attention`; checked "
    "against per-request references (adds `queries` tokens to every row)",
    target=_target,
    oracles=_oracles,
    optional=(
        ("`kv_seed: int`", "seed of the new tokens' K/V; default `q_seed + 1`"),
        ("`window_size: int`", "passed to `make_mask` and used by the reference masks"),
        ("`scale: float`", "K/V scale, as in `update`"),
    ),
    checks=(
        Check(
            "attention",
            CONTRACT,
            False,
            "attention equals exact attention over the per-request TurboQuant reference",
        ),
    ),
    observe=_observe,
    recorded=(
        Recorded(
            "attention",
            ("attention",),
            {
                "atol": 1e-5,
                "rtol": 0,
                "max_mismatch_fraction": 0,
                "reason": "same packed bits and mask through mlx-vlm's "
                "scaled_dot_product_attention; an implementation may hand it a differently "
                "sized (masked) state, which reorders float32 sums (~1e-6). A wrong or missing "
                "token moves outputs by > 1e-2. Only queries at non-padding positions are "
                "compared.",
                "cross_platform": {
                    "atol": 1e-3,
                    "rtol": 0,
                    "max_mismatch_fraction": 0,
                    "reason": CROSS_PLATFORM_NOTE + " A flipped bucket moves one key or value "
                    "coordinate; averaged by softmax over the row it shifts outputs by well under "
                    "1e-3, while a poisoned (16x) or missing token moves them by > 1e-2.",
                },
            },
        ),
    ),
    rules=(Rule("decode", _decode, doc=_decode.__doc__),),
    notes=(
        "`attend` is a *forward step*, as a model layer performs it: `mask = "
        "target.make_mask(queries, return_array=True)`, then `update_and_fetch` of `queries` new "
        "tokens (K/V from `kv_seed`), then attention over the returned states. So `attend` "
        "appends `queries` tokens to every row, exactly like an `update` of that many tokens. "
        "Queries that fall on padding slots are not compared (their outputs are unused by any "
        "model).",
    ),
)
