"""CI's device choice, as ci.yml writes it, on simulated Macs: each GPU ends in its lane.

The step (``choose the device that passes the known-answer check``) is read
from the workflow file and run in bash, its ``.venv/bin/tqbatch`` being this
interpreter's tqbatch, on a simulated Mac (``tests/simulated_mac``:
``tqbatch.testing.backend.simulated_metal``, MLX 0.32's dispatch rule). The README
promises: the GPU where its check passes, else the CPU lane, where no Metal
kernel runs. What only simulation saw: no real Mac has run this step.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "tests" / "simulated_mac"
STEP = "choose the device that passes the known-answer check"


def _device_choice_script() -> str:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    (step,) = [s for s in workflow["jobs"]["tests"]["steps"] if s.get("name") == STEP]
    return step["run"].replace(".venv/bin/tqbatch", f"{shlex.quote(sys.executable)} -m tqbatch")


def _choose(tmp_path: Path, gpu: str) -> tuple[str, dict[str, dict], list[dict], str]:
    """Run the step on a simulated GPU answering ``gpu``: (lane, reports, launches, output)."""
    github_env = tmp_path / "github_env"
    summary = tmp_path / "summary.md"
    log = tmp_path / "launches.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("TQBATCH_DEVICE", "PYTHONPATH")}
    env.update(
        PYTHONPATH=str(SITE),
        TQBATCH_SIMULATED_METAL=gpu,
        TQBATCH_SIMULATED_METAL_LOG=str(log),
        GITHUB_ENV=str(github_env),
        GITHUB_STEP_SUMMARY=str(summary),
    )
    run = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", _device_choice_script()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    lanes = [line.split("=", 1)[1] for line in github_env.read_text().splitlines()]
    reports = {
        path.stem: json.loads(path.read_text())
        for path in sorted((tmp_path / "backend-report").glob("*.json"))
    }
    launches = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert summary.read_text().count("### tqbatch backend check") == len(reports)
    (lane,) = lanes
    return lane, reports, launches, output


def test_a_gpu_that_passes_is_the_lane(tmp_path):
    lane, reports, launches, _ = _choose(tmp_path, "pass")
    assert lane == "gpu"
    assert list(reports) == ["gpu"]
    check = reports["gpu"]["kernel_check"]
    assert reports["gpu"]["passed"] and check["passed"] and not check["retried_after"]
    assert all(case["passed"] for case in check["cases"])
    # The kernels really ran (emulated), and the report says which.
    assert launches and {launch["outcome"] for launch in launches} == {"emulated"}
    ran = reports["gpu"]["backend"]["lane"]["kernels_launched"]
    assert sum(ran.values()) == len(launches)


@pytest.mark.parametrize(
    "gpu, why",
    [
        ("zeros", "returned all zeros"),
        ("raise", "Unable to"),  # a pipeline that never builds: retried once, then the CPU
        ("absent", "has no attribute 'metal_kernel'"),
    ],
)
def test_a_gpu_that_fails_its_check_leaves_the_cpu_lane(tmp_path, gpu, why):
    lane, reports, launches, output = _choose(tmp_path, gpu)
    assert lane == "cpu"
    assert list(reports) == ["cpu", "gpu"]
    assert not reports["gpu"]["passed"] and why in reports["gpu"]["failure"]
    assert bool(reports["gpu"]["kernel_check"]["retried_after"]) == (gpu == "raise")
    cpu = reports["cpu"]
    assert cpu["passed"] and cpu["kernel_check"] is None
    assert cpu["backend"]["lane"] == {
        "lane": "cpu",
        "mlx_vlm_metal": "Metal kernels kept off",
        "kernels_launched": {},
    }
    assert why in output  # the log says why the GPU was not taken


def test_a_pipeline_that_fails_to_build_once_is_retried_and_the_gpu_kept(tmp_path):
    lane, reports, _, _ = _choose(tmp_path, "flaky")
    assert lane == "gpu"
    first_attempt = reports["gpu"]["kernel_check"]["retried_after"]
    assert first_attempt and all("Unable to" in problem for problem in first_attempt)
    assert "after one retry of a failed pipeline build" in reports["gpu"]["backend"]["kernels"]
