"""The precision policy and the backend's known-answer check."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from tqbatch.testing import backend


def test_suite_runs_at_full_float32():
    # The root conftest chose float32 before mlx was imported; measured, not assumed.
    assert backend.requested_precision() == "float32"
    assert backend.matmul_precision() == "float32"


def test_precision_cannot_change_once_mlx_is_imported():
    backend.select_precision("float32")  # the setting in force: accepted
    with pytest.raises(backend.BackendError, match="before mlx is imported"):
        backend.select_precision("tf32")
    assert backend.requested_precision() == "float32"


def test_unknown_precision_and_device_are_rejected():
    with pytest.raises(ValueError, match="precision 'fp16'"):
        backend.select_precision("fp16")
    with pytest.raises(ValueError, match="device 'tpu'"):
        backend.select_device("tpu")


def test_known_answer_check_passes_and_describes_the_backend():
    info = backend.check_backend()
    assert info["precision"] == info["matmul_precision"] == "float32"
    assert info["device"] in backend.DEVICES and info["device_name"]
    line = backend.describe_line(info)
    assert "MLX_ENABLE_TF32=0" in line and info["device"] in line


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
    monkeypatch.setattr(backend, "matmul_precision", lambda: "tf32")
    with pytest.raises(backend.BackendError, match="float32 was requested but matmuls run at TF32"):
        backend.check_backend()


def _tqbatch(*args):
    return subprocess.run(
        [sys.executable, "-m", "tqbatch", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_reports_the_backend_and_records_the_precision_asked_for():
    default = _tqbatch("backend", "--json")
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout)["precision"] == "float32"
    tf32 = _tqbatch("backend", "--json", "--precision", "tf32")
    assert tf32.returncode == 0, tf32.stderr
    info = json.loads(tf32.stdout)
    assert info["precision"] == "tf32"
    # Measured, not assumed: the CPU has no TF32, GPUs of CUDA / M5 have.
    assert info["matmul_precision"] in ("float32", "tf32")


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="this MLX build has a GPU")
def test_cli_refuses_a_device_the_build_lacks():
    run = _tqbatch("fuzz", "--examples", "1", "--device", "gpu")
    assert run.returncode == 3
    assert "no gpu backend" in run.stderr
