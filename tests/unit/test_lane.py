"""The CPU lane: chosen from the environment at import, kept for mlx-vlm too, reported.

Each case runs in a fresh interpreter, since the lane is a process's and must
hold from the first import on (``tqbatch.testing.backend.lane``). Where no Metal is
present, closing mlx-vlm's gate changes no computation: these tests check the
gate itself; the simulated Mac (``tests/unit/test_simulated_mac.py``) checks
that no Metal kernel runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tqbatch.testing.backend import lane


def _python(code: str, **env) -> dict:
    environment = {k: v for k, v in os.environ.items() if k != "TQBATCH_DEVICE"}
    environment.update(env)
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


_REPORT = """
import json, sys
import mlx.core as mx
import mlx_vlm.turboquant as turboquant
from tqbatch.testing.backend import lane
print(json.dumps({
    "closed": turboquant._metal_available is lane._closed_gate,
    "device": str(mx.default_device().type),
    "lane": lane.chosen(),
}))
"""


@pytest.mark.parametrize("order", ["tqbatch.testing first", "mlx and mlx-vlm first"])
def test_the_environment_cpu_lane_holds_from_the_import_of_tqbatch_testing(order):
    first = "import tqbatch.testing\n" if order == "tqbatch.testing first" else ""
    later = "" if first else "import mlx.core, mlx_vlm.turboquant\nimport tqbatch.testing\n"
    seen = _python(first + later + _REPORT, TQBATCH_DEVICE="cpu")
    assert seen == {"closed": True, "device": "DeviceType.cpu", "lane": "cpu"}


def test_importing_tqbatch_testing_imports_no_mlx():
    seen = _python(
        "import json, sys\nimport tqbatch.testing\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('mlx', 'mlx_vlm')))))",
        TQBATCH_DEVICE="cpu",
    )
    assert seen == []


def test_without_a_lane_mlx_vlm_keeps_its_own_gate():
    seen = _python("import tqbatch.testing\n" + _REPORT)
    assert seen["closed"] is False and seen["lane"] is None


def test_choosing_a_lane_closes_and_reopens_mlx_vlm_gate():
    import mlx_vlm.turboquant as turboquant

    real = getattr(turboquant, "_tqbatch_metal_available", turboquant._metal_available)
    before = dict(lane._state)
    try:
        lane.choose("gpu")
        assert turboquant._metal_available is real
        assert not lane.mlx_vlm_kernels_kept_off()
        lane.choose("cpu")
        assert turboquant._metal_available is lane._closed_gate
        assert lane.describe()["lane"] == "cpu"
    finally:
        lane.choose("cpu" if before["kept_off"] else "gpu")
        lane._state.update(before)


def test_a_lane_must_be_cpu_or_gpu():
    with pytest.raises(ValueError, match="'cpu' or 'gpu'"):
        lane.choose("metal")
