"""``extract``: one request read out of the batch as a single-request cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from tqbatch.testing.contract.checks import CONTRACT, POLICY, Check
from tqbatch.testing.contract.observation import packed_leaves
from tqbatch.testing.contract.ops.declaration import BadInput, Op, Recorded, Rule, out_of_domain
from tqbatch.testing.oracles.judges import judge_tokens
from tqbatch.testing.oracles.reference import to_numpy
from tqbatch.testing.oracles.tolerances import CROSS_PLATFORM_NOTE, EXACT, PACKED_CROSS_PLATFORM
from tqbatch.testing.oracles.vectorized_fallback import vectorized_fallback


def _validate(world, op):
    rows = world.numpy_model.batch_size
    if not 0 <= int(op["index"]) < rows:
        raise out_of_domain(op, f"index is not a row of the {rows}-row batch")


def _target(world, op):
    return world.target.extract(int(op["index"]))


def _oracles(world, op, single):
    b = int(op["index"])
    rid = world.numpy_model.rows[b].request.id
    pending = world.numpy_model.right_padding[b] if world.numpy_model.right_padding else 0
    length = max(0, world.numpy_model.row_length(b) - pending)
    got_len = 0 if single.keys is None else int(single.offset)
    if got_len != length and pending and got_len == world.numpy_model.row_length(b):
        # BatchKVCache's extract: the row's slots to the written end, the
        # pending padding as tokens. A legal choice mid-prefill (tqbatch
        # leaves it out): the extracted cache is held to what it chose.
        world.report(
            "extract_pending",
            op,
            f"extract({b}) holds the {pending} slot(s) of right padding still pending as "
            f"tokens ({got_len} tokens; tqbatch leaves them out: {length})",
        )
        length = got_len
    if got_len != length:
        world.report(
            "extract_length", op, f"extract({b}) holds {got_len} tokens, request {rid} has {length}"
        )
        return {"length": length}
    out = {"length": length}
    if length:
        with vectorized_fallback():  # the harness reading an mlx-vlm cache, not the target
            got_k, got_v = single.dequantize()
        got_k, got_v = to_numpy(got_k[0]), to_numpy(got_v[0])
        for side, (name, got) in enumerate((("keys", got_k), ("values", got_v))):
            want = world.refs.dequantized(rid)[side][:, :length]
            if got.shape != want.shape:
                world.report(
                    "extract_content",
                    op,
                    f"extract({b}) {name} shape {got.shape}, expected {want.shape}",
                )
                continue
            judgement = judge_tokens(
                got,
                lambda: world.refs.dequantized(rid)[side][:, :length],  # noqa: B023 (judged at once)
                lambda tol: world.refs.admit_rounding(rid, name, got, tol) is not None,  # noqa: B023
            )
            if not judgement.passed:
                world.report(
                    "extract_content",
                    op,
                    f"extract({b}) {name} differ from the reference {judgement.detail()}",
                )
        out.update(keys=got_k, values=got_v)
        if pending == 0:
            dk, dv = world.dense.extract(b)
            mk, mv = world.numpy_model.tokens(b)
            if not (np.array_equal(dk, mk) and np.array_equal(dv, mv)):
                world.report(
                    "harness", op, f"BatchKVCache.extract({b}) disagrees with the numpy model"
                )
        # The extracted cache must be independent: append a poison token to it;
        # the checks after the op then show the batch row did not move.
        poison = world.poison_row_token(1, np.random.default_rng(b))
        with vectorized_fallback():
            single.update_and_fetch(poison, poison)
            mx.eval(single.keys, single.values)
    return out


def _observe(target, op, result):
    single = target.extract(int(op["index"]))  # extract leaves the target unchanged
    obs = {"extract.length": np.array([result["length"]], dtype=np.int64)}
    if result["length"]:
        obs["extract.keys"] = np.array(result["keys"], dtype=np.float32)
        obs["extract.values"] = np.array(result["values"], dtype=np.float32)
        state = single.state
        obs.update(packed_leaves(state[0], "extract_state.keys"))
        obs.update(packed_leaves(state[1], "extract_state.values"))
    return obs


def _extract(machine, data):
    index = data.draw(st.integers(0, machine.numpy_model.batch_size - 1), label="index")
    return [{"op": "extract", "index": index}]


OP = Op(
    name="extract",
    fields="`index: int`",
    meaning="`target.extract(index)`; content checked against the reference, target unchanged",
    target=_target,
    oracles=_oracles,
    validate=_validate,
    needs=("extract",),
    checks=(
        Check("extract_length", CONTRACT, False, "extract(i) holds the request's token count"),
        Check("extract_content", CONTRACT, False, "extract(i) holds the request's K/V"),
        Check(
            "extract_pending",
            POLICY,
            False,
            "extract(i) leaves out right padding still pending (BatchKVCache's returns it)",
        ),
    ),
    observe=_observe,
    recorded=(
        Recorded(
            "extract_length",
            ("extract.length",),
            {**EXACT, "reason": "integer: tokens of the extracted request"},
        ),
        Recorded(
            "extract_state",
            ("extract_state",),
            {
                **EXACT,
                "reason": "extract() copies packed bits: bit-identical to the batch row.",
                "cross_platform": PACKED_CROSS_PLATFORM,
            },
        ),
        Recorded(
            "extract_dequantized",
            ("extract.keys", "extract.values"),
            {
                "atol": 1e-6,
                "rtol": 0,
                "max_mismatch_fraction": 0,
                "reason": "same packed bits through the same codec: only float32 rounding of "
                "the dequantize (measured 0.0 across processes on CPU); a flipped bucket or a "
                "wrong token moves a coordinate by > 1e-2.",
                "cross_platform": {
                    "atol": 1e-5,
                    "rtol": 0,
                    "max_mismatch_fraction": 0.02,
                    "reason": CROSS_PLATFORM_NOTE + " 2% of coordinates may move by a bucket; "
                    "the rest by float32 rounding of a different rotation kernel.",
                },
            },
        ),
    ),
    bad_inputs=(
        BadInput(
            "extract-out-of-range", "IndexError", lambda b: {"op": "extract", "index": b.rows}
        ),
    ),
    rules=(Rule("extract", _extract, lambda machine: machine.has("extract")),),
)
