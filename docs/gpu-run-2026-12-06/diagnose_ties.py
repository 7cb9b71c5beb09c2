"""Why a model-matrix cell's greedy token differs from the request run alone.

Runs the given cells (default: the five that failed at TF32 with the fused decode
kernel on, 2026-12-05) for tqbatch and BatchKVCache under the current
MLX_ENABLE_TF32 and TQBATCH_DECODE_KERNEL, and for a token mismatch
("X's token n is a, alone b") prints the margin between the two tokens in the
alone run's logits, the alone run's top-2 margin there, and the batch's own
logprobs for both tokens. Also: over every alone step of the cell, the smallest
top-2 logit margin (how close the tiny random model's ties are), and the
largest logprob gap from alone over the tokens taken before the mismatch.

    python3 docs/gpu-run-2026-12-06/diagnose_ties.py [family:scenario ...]
"""

from __future__ import annotations

import json
import os
import re
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator

from tqbatch import _cuda_decode
from tqbatch.testing import backend
from tqbatch.workbench import model_matrix

CELLS = [
    ("mlx-lm:llama", "batch_generator"),
    ("mlx-lm:phi3", "batch_generator"),
    ("mlx-lm:qwen2", "batch_generator"),
    ("mlx-lm:qwen3_moe", "batch_generator"),
    ("mlx-lm:gemma3_text", "uniform_rollback"),
]

captured: dict[str, object] = {}
_alone = model_matrix._alone_run


def _recording_alone(model, family, target, layers, uid, prompt, steps):
    req = _alone(model, family, target, layers, uid, prompt, steps)
    captured[uid] = req
    return req


model_matrix._alone_run = _recording_alone
last_responses: list = []
_next = BatchGenerator.next_generated


def _recording_next(self):
    out = _next(self)
    last_responses[:] = [(r.uid, r.token, np.array(r.logprobs.astype(mx.float32))) for r in out]
    return out


BatchGenerator.next_generated = _recording_next


def _top2(row: np.ndarray) -> float:
    a = np.sort(row)[-2:]
    return float(a[1] - a[0])


def diagnose(family: str, scenario: str, target_name: str) -> dict:
    captured.clear()
    last_responses.clear()
    cell = model_matrix.run_cell(family, scenario, model_matrix.target_for(target_name))
    out = {
        "cell": f"{family}-{scenario}",
        "target": target_name,
        "status": cell.status,
        "detail": cell.short(),
        "min_top2_margin_alone": min(
            (_top2(row) for r in captured.values() for row in (r.alone or [])), default=None
        ),
    }
    m = re.search(r"(\w)'s token (\d+) is (\d+), alone (\d+)", cell.detail)
    if m:
        uid, n, got, want = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        req = captured[uid]
        row = req.alone[n]
        out["mismatch"] = {
            "request": uid,
            "position": n,
            "batch_token": got,
            "alone_token": want,
            "alone_logit_margin": float(row[want] - row[got]),
            "alone_top2_margin": _top2(row),
            "gap_before": max(req.gaps, default=None),
        }
        for _uid, token, logprobs in last_responses:
            if token == got:
                out["mismatch"]["batch_logprob_margin"] = float(logprobs[got] - logprobs[want])
    return out


def main(argv: list[str]) -> None:
    cells = [tuple(a.rsplit(":", 1)) for a in argv] or CELLS
    print(
        "#",
        backend.describe_line(),
        f"precision={backend.requested_precision()}",
        f"TQBATCH_DECODE_KERNEL={_cuda_decode.mode()}",
        f"TQBATCH_DECODE_TF32={os.environ.get('TQBATCH_DECODE_TF32', '')}",
        flush=True,
    )
    for family, scenario in cells:
        for target in ("tqbatch", model_matrix.BASELINE):
            print(json.dumps(diagnose(family, scenario, target)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
