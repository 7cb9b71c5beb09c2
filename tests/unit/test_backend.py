"""The precision policy and the backend's known-answer check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from tqbatch.testing import backend


def test_suite_runs_at_the_precision_asked_for(pytestconfig):
    # The root conftest chose the precision before mlx was imported: float32
    # unless --precision / $TQBATCH_PRECISION asked for TF32. Measured, not assumed.
    asked = (
        pytestconfig.getoption("--precision") or os.environ.get("TQBATCH_PRECISION") or "float32"
    )
    assert backend.requested_precision() == asked
    if asked == "float32":
        assert backend.matmul_precision() == "float32"


def test_precision_cannot_change_once_mlx_is_imported():
    in_force = backend.requested_precision()
    other = "tf32" if in_force == "float32" else "float32"
    backend.select_precision(in_force)  # the setting in force: accepted
    with pytest.raises(backend.BackendError, match="before mlx is imported"):
        backend.select_precision(other)
    assert backend.requested_precision() == in_force


def test_unknown_precision_and_device_are_rejected():
    with pytest.raises(ValueError, match="precision 'fp16'"):
        backend.select_precision("fp16")
    with pytest.raises(ValueError, match="device 'tpu'"):
        backend.select_device("tpu")


def test_known_answer_check_passes_and_describes_the_backend():
    info = backend.check_backend()
    assert info["precision"] == backend.requested_precision()
    assert info["matmul_precision"] == backend.matmul_precision()
    assert info["device"] in backend.DEVICES and info["device_name"]
    line = backend.describe_line(info)
    flag = "MLX_ENABLE_TF32=0" if info["precision"] == "float32" else "MLX_ENABLE_TF32=1"
    assert flag in line and info["device"] in line


def test_a_backend_returning_zeros_stops_the_run(monkeypatch):
    """A paravirtual GPU whose kernels return zeros fails the check by name."""
    monkeypatch.setattr(
        mx.fast,
        "scaled_dot_product_attention",
        lambda q, k, v, **kw: mx.zeros(q.shape, dtype=q.dtype),
    )
    with pytest.raises(backend.BackendError, match="fused attention"):
        backend.check_backend()


def test_a_wrong_gather_stops_the_run(monkeypatch):
    real = mx.array.__getitem__

    def off_by_one(self, index):
        out = real(self, index)
        return out + 1 if isinstance(index, mx.array) else out

    monkeypatch.setattr(mx.array, "__getitem__", off_by_one)
    with pytest.raises(backend.BackendError, match="gather"):
        backend.check_backend()


def test_tf32_where_float32_was_requested_stops_the_run(monkeypatch):
    monkeypatch.setattr(backend, "requested_precision", lambda: "float32")
    monkeypatch.setattr(backend, "matmul_precision", lambda: "tf32")
    with pytest.raises(backend.BackendError, match="float32 was requested but matmuls run at TF32"):
        backend.check_backend()


def _tqbatch(*args):
    # As a user runs it: no precision chosen in the environment (the suite may
    # have been asked for one).
    env = {k: v for k, v in os.environ.items() if k not in ("TQBATCH_PRECISION", "MLX_ENABLE_TF32")}
    return subprocess.run(
        [sys.executable, "-m", "tqbatch", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_cli_reports_the_backend_and_records_the_precision_asked_for():
    default = _tqbatch("backend", "--json")
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout)["backend"]["precision"] == "float32"
    tf32 = _tqbatch("backend", "--json", "--precision", "tf32")
    assert tf32.returncode == 0, tf32.stderr
    info = json.loads(tf32.stdout)["backend"]
    assert info["precision"] == "tf32"
    # Measured, not assumed: the CPU has no TF32, GPUs of CUDA / M5 have.
    assert info["matmul_precision"] in ("float32", "tf32")


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="this MLX build has a GPU")
def test_cli_refuses_a_device_the_build_lacks():
    run = _tqbatch("fuzz", "--examples", "1", "--device", "gpu")
    assert run.returncode == 3
    assert "no gpu backend" in run.stderr


def test_the_backend_command_reports_what_it_saw(tmp_path):
    """--report writes the check as JSON and the step summary gets it as a table."""
    summary = tmp_path / "summary.md"
    report = tmp_path / "reports" / "cpu.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TQBATCH_PRECISION", "MLX_ENABLE_TF32")}
    env["GITHUB_STEP_SUMMARY"] = str(summary)
    run = subprocess.run(
        [sys.executable, "-m", "tqbatch", "backend", "--device", "cpu", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    saved = json.loads(report.read_text())
    assert saved["passed"] is True and saved["failure"] is None
    assert saved["backend"]["device"] == "cpu"
    assert saved["backend"]["lane"]["lane"] == "cpu"
    assert saved["backend"]["lane"]["kernels_launched"] == {}
    assert "lane cpu" in run.stdout
    table = summary.read_text()
    assert "### tqbatch backend check on the cpu lane: passed" in table
    assert "| kernels launched | none |" in table
