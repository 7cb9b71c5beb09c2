"""On a simulated Mac, the CPU lane launches no Metal kernel; without it, mlx-vlm would.

Each case is a fresh interpreter started on a simulated Mac
(``tests/simulated_mac/sitecustomize.py``: Metal pretended from the start,
every ``mx.fast.metal_kernel`` launch logged and refused, MLX 0.32's rule that
a kernel launched without a stream runs on the GPU whatever the default
device). What only simulation saw: no real Mac has run this.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tqbatch.testing.backend.simulated_metal import read_launch_log

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "tests" / "simulated_mac"

# Every op of tqbatch's cache a server takes, on one small batch, then mlx-vlm's
# own per-request cache (the harness's reference) written and attended.
EVERY_OP = """
import mlx.core as mx
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.turboquant import TurboQuantKVCache
from tqbatch import BatchTurboQuantKVCache

H, D = 2, 64
a, b = TurboQuantKVCache(bits=4, seed=0), TurboQuantKVCache(bits=4, seed=0)
a.update_and_fetch(mx.random.normal((1, H, 5, D)), mx.random.normal((1, H, 5, D)))
b.update_and_fetch(mx.random.normal((1, H, 3, D)), mx.random.normal((1, H, 3, D)))
batch = BatchTurboQuantKVCache.merge([a, b])
for step in range(2):
    mask = batch.make_mask(1)
    k, v = batch.update_and_fetch(mx.random.normal((2, H, 1, D)), mx.random.normal((2, H, 1, D)))
    out = scaled_dot_product_attention(mx.random.normal((2, 4, 1, D)), k, v, batch,
                                       scale=D ** -0.5, mask=mask)
    mx.eval(out)
other = BatchTurboQuantKVCache.merge([a])
batch.extend(other)
batch.filter([0, 2])
done = batch.extract(1)
copy = BatchTurboQuantKVCache.from_state(batch.state, batch.meta_state)
mx.eval(copy.update_and_fetch(mx.random.normal((2, H, 1, D)), mx.random.normal((2, H, 1, D))))
k, v = a.update_and_fetch(mx.random.normal((1, H, 1, D)), mx.random.normal((1, H, 1, D)))
mx.eval(scaled_dot_product_attention(mx.random.normal((1, 4, 1, D)), k, v, a, scale=D ** -0.5,
                                     mask=None))
print("done")
"""


def _on_simulated_mac(tmp_path, code: str, mode: str = "refuse", **env) -> list[dict]:
    log = tmp_path / "launches.jsonl"
    environment = {k: v for k, v in os.environ.items() if k != "TQBATCH_DEVICE"}
    environment.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(SITE), environment.get("PYTHONPATH")])),
        TQBATCH_SIMULATED_METAL=mode,
        TQBATCH_SIMULATED_METAL_LOG=str(log),
        **env,
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environment
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("done")
    return read_launch_log(log) if log.exists() else []


@pytest.mark.parametrize("rule", ["0.32", "0.31"])
def test_the_cpu_lane_launches_no_metal_kernel(tmp_path, rule):
    code = "import tqbatch.testing\n" + EVERY_OP
    launches = _on_simulated_mac(tmp_path, code, mode=f"refuse:{rule}", TQBATCH_DEVICE="cpu")
    assert launches == []


def test_tqbatch_caches_alone_follow_the_default_device(tmp_path):
    """No harness: a server that makes the CPU MLX's default gets no Metal kernel from tqbatch.

    The per-request caches are tqbatch's ``BatchableTurboQuantKVCache`` (what
    ``tqbatch.mlx_lm.make_prompt_cache`` builds), mlx-vlm's class plus ``merge``.
    """
    code = "import mlx.core as mx\nmx.set_default_device(mx.cpu)\n" + EVERY_OP.replace(
        "TurboQuantKVCache(bits=4, seed=0)", "BatchableTurboQuantKVCache(bits=4, seed=0)"
    ).replace(
        "from tqbatch import BatchTurboQuantKVCache",
        "from tqbatch import BatchableTurboQuantKVCache, BatchTurboQuantKVCache",
    )
    assert _on_simulated_mac(tmp_path, code) == []


def test_a_merge_of_full_precision_rows_follows_the_default_device(tmp_path):
    """No harness: rows that ran alone in full-precision ``KVCache``s (mlx-vlm's qwen3_5
    re-batches them so) are quantized without a Metal kernel where the CPU is the default."""
    code = (
        "import mlx.core as mx\nmx.set_default_device(mx.cpu)\n"
        "from mlx_lm.models.cache import KVCache\nfrom tqbatch import BatchTurboQuantKVCache\n"
        "rows = [KVCache(), KVCache()]\n"
        "for n, row in zip((5, 3), rows):\n"
        "    row.update_and_fetch(*(mx.random.normal((1, 2, n, 64)) for _ in 'kv'))\n"
        "batch = BatchTurboQuantKVCache.configured(bits=4.0).merge(rows)\n"
        "mx.eval(batch.dequantize())\nprint('done')\n"
    )
    assert _on_simulated_mac(tmp_path, code, mode="zeros") == []


def test_without_the_lane_mlx_vlm_launches_on_the_gpu(tmp_path):
    """The check can fail: MLX's CPU default alone does not keep mlx-vlm's class off Metal."""
    code = "import mlx.core as mx\nmx.set_default_device(mx.cpu)\n" + EVERY_OP
    launches = _on_simulated_mac(tmp_path, code, mode="zeros")
    assert launches, "mlx-vlm's own cache launched nothing on a simulated Mac"
    assert {launch["device"] for launch in launches} == {"gpu"}


def test_the_backend_check_on_the_cpu_lane_launches_nothing(tmp_path):
    code = (
        "import sys\nfrom tqbatch.cli import main\n"
        "code = main(['backend', '--device', 'cpu'])\nprint('done')\nsys.exit(code)\n"
    )
    assert _on_simulated_mac(tmp_path, code) == []


def test_deciding_by_metal_presence_alone_would_launch(tmp_path):
    """The check can fail: the rule before (Metal present means kernels) launches on a Mac's CPU."""
    old_rule = (
        "import mlx.core as mx\nmx.set_default_device(mx.cpu)\n"
        "import tqbatch._codec, tqbatch._devices, tqbatch.cache\n"
        "for module in (tqbatch._codec, tqbatch._devices, tqbatch.cache):\n"
        "    module.metal_kernels_here = mx.metal.is_available\n"
    )
    code = old_rule + EVERY_OP.replace(
        "TurboQuantKVCache(bits=4, seed=0)", "BatchableTurboQuantKVCache(bits=4, seed=0)"
    ).replace(
        "from tqbatch import BatchTurboQuantKVCache",
        "from tqbatch import BatchableTurboQuantKVCache, BatchTurboQuantKVCache",
    )
    launches = _on_simulated_mac(tmp_path, code, mode="zeros")
    assert {launch["device"] for launch in launches} == {"gpu"}
