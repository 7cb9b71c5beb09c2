"""The MLX backend a harness run computes on: precision, device, a known-answer check.

A verdict about a cache is only as good as the arithmetic under it, so every
harness entry point (the root ``conftest.py``, the ``tqbatch`` CLI, nox)
does three things before it tests anything:

1. **Precision.** MLX runs float32 matmuls at TF32 precision by default on
   CUDA and Apple M5 GPUs (``MLX_ENABLE_TF32`` defaults to 1 and is read once,
   on first use). The harness runs at full float32 unless told otherwise:
   :func:`select_precision` sets ``MLX_ENABLE_TF32`` and must run before mlx
   is imported. ``tf32`` is the explicit opt-in to the precision users serve
   with; tolerances follow (``tqbatch.testing.oracles.tolerances``).
2. **Device.** :func:`select_device` makes the CPU or the GPU stream MLX's
   default device.
3. **A known-answer check.** :func:`check_backend` computes a few things
   whose answers are known exactly (integer matmuls, a matmul that tells
   float32 from TF32, bit packing, gathers, a Hadamard transform, fused
   attention) and raises :class:`BackendError` if any is wrong, or if the
   measured matmul precision is not the one requested. Where the cache runs
   mlx-vlm's Metal kernels (:func:`kernels_in_use`: Metal present and the GPU
   lane), it also runs each write, read-out and decode step the cache takes
   there through those kernels and through plain MLX ops, at tiny shapes, and
   names every disagreement, error and all-zeros result
   (``tqbatch.testing.backend.kernel_check``). A paravirtual or broken GPU (GitHub's
   hosted macOS runners expose one; custom kernels have returned zeros there)
   then stops the run with that message instead of turning into cache
   failures. A kernel whose pipeline fails to build is tried once more, and
   the report says so (hosted Macs' paravirtual GPU is known to fail a build
   now and then).

On the CPU lane (``select_device("cpu")``) no Metal kernel runs at all, the
harness's mlx-vlm caches included (``tqbatch.testing.backend.lane``), so the kernel
check has nothing to check there.

:func:`describe` is what reports and saved failures record: mlx version,
device, requested and measured precision, which custom kernels the cache
runs and whether they were checked, and the lane with the custom kernels
launched so far (``tqbatch.testing.backend.lane``). :func:`kernel_report` and
:func:`device_memory` complete ``tqbatch backend``'s report.

Importing this module does not import mlx.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from importlib import metadata

from tqbatch.testing.backend import lane

__all__ = [
    "DEVICES",
    "PRECISIONS",
    "BackendError",
    "check_backend",
    "describe",
    "describe_line",
    "device_memory",
    "kernel_report",
    "kernels_in_use",
    "matmul_precision",
    "requested_precision",
    "select_device",
    "select_precision",
]

PRECISIONS = ("float32", "tf32")
DEVICES = ("cpu", "gpu")
DEFAULT_PRECISION = "float32"
TF32_VARIABLE = "MLX_ENABLE_TF32"
# Environment variables the entry points read (nox and CI set these).
PRECISION_VARIABLE = "TQBATCH_PRECISION"
DEVICE_VARIABLE = "TQBATCH_DEVICE"


class BackendError(RuntimeError):
    """The backend cannot give trustworthy answers (or not at the requested precision)."""


def select_precision(precision: str | None = None) -> str:
    """Make MLX compute float32 matmuls at ``precision``; returns the precision chosen.

    ``None`` takes ``$TQBATCH_PRECISION``, else ``float32``. Sets
    ``MLX_ENABLE_TF32``; raises ``BackendError`` if mlx is already imported
    with a different setting (MLX reads it once; changing it later would
    silently not apply).
    """
    precision = precision or os.environ.get(PRECISION_VARIABLE) or DEFAULT_PRECISION
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    wanted = "1" if precision == "tf32" else "0"
    current = os.environ.get(TF32_VARIABLE)
    if "mlx.core" in sys.modules and current != wanted:
        raise BackendError(
            f"precision {precision} must be chosen before mlx is imported: mlx is already "
            f"imported with {TF32_VARIABLE}={current!r}; set {TF32_VARIABLE}={wanted} "
            "(or TQBATCH_PRECISION) in the environment instead"
        )
    os.environ[TF32_VARIABLE] = wanted
    os.environ[PRECISION_VARIABLE] = precision  # child processes (xdist workers) follow
    return precision


def requested_precision() -> str:
    """The precision asked of MLX: ``tf32`` unless ``MLX_ENABLE_TF32=0`` (MLX's default)."""
    return "float32" if os.environ.get(TF32_VARIABLE) == "0" else "tf32"


def select_device(device: str | None = None) -> str:
    """Make ``device`` (``cpu`` or ``gpu``) MLX's default; ``None`` takes ``$TQBATCH_DEVICE``.

    Without either, MLX's own default stays (the GPU where there is one).
    Returns the device type now in use.
    """
    import mlx.core as mx

    device = device or os.environ.get(DEVICE_VARIABLE)
    if device is not None:
        if device not in DEVICES:
            raise ValueError(f"device {device!r}: expected one of {', '.join(DEVICES)}")
        target = mx.gpu if device == "gpu" else mx.cpu
        if not mx.is_available(target):
            raise BackendError(f"device {device}: this MLX build has no {device} backend")
        mx.set_default_device(target)
        os.environ[DEVICE_VARIABLE] = device
    lane.choose(_device_type())
    return _device_type()


def _device_type() -> str:
    import mlx.core as mx

    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def _device_name() -> str:
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - older or partial builds: name what we can
        return _device_type()
    return str(info.get("device_name") or info.get("architecture") or _device_type())


@functools.cache
def _measured_precision(device_type: str) -> str:
    import mlx.core as mx
    import numpy as np

    # 1 + 2**-12 survives a float32 product exactly but not TF32's 10-bit
    # mantissa. 128 x 128 so that every backend takes its GEMM path.
    n = 128
    a = mx.eye(n, dtype=mx.float32) * (1.0 + 2.0**-12)
    diagonal = np.diag(np.array(a @ mx.eye(n, dtype=mx.float32)))
    if np.all(diagonal == np.float32(1.0 + 2.0**-12)):
        return "float32"
    if np.all(diagonal == np.float32(1.0)):
        return "tf32"
    raise BackendError(
        f"{device_type}: a float32 identity matmul returned {sorted(set(diagonal.tolist()))[:4]}, "
        f"expected {1.0 + 2.0**-12!r} (float32) or 1.0 (TF32)"
    )


def matmul_precision() -> str:
    """The precision float32 matmuls actually run at on the default device (measured once)."""
    return _measured_precision(_device_type())


def kernels_in_use() -> bool:
    """Whether the cache's codec steps run mlx-vlm's Metal kernels in this process.

    Where Metal is present and work runs on the GPU: tqbatch's cache decides
    per call (``tqbatch._devices.metal_kernels_here``), and on the CPU lane
    mlx-vlm's own classes are kept off Metal too (``tqbatch.testing.backend.lane``).
    """
    from tqbatch._devices import metal_kernels_here

    return metal_kernels_here() and not lane.mlx_vlm_kernels_kept_off()


# What the kernel check saw in this process, by device type: its per-case
# results, and the first attempt's problems where a pipeline build failed and
# the check was run again.
_KERNEL_CHECKS: dict[str, dict] = {}

# How MLX's Metal backend words a kernel whose library or pipeline state did
# not build (mlx/backend/metal/device.cpp); the one failure worth a retry.
_PIPELINE_BUILD = re.compile(
    r"Unable to (build metal library|load (kernel|function)|create (compute )?pipeline)"
    r"|pipeline state",
    re.IGNORECASE,
)


def _kernel_problems() -> list[str]:
    """mlx-vlm's Metal kernels against plain MLX ops where the cache runs them; else nothing.

    Where they do not run this returns at once: mlx-vlm is not even imported.
    A check whose only problems are pipeline builds that failed is run once
    more; both attempts are recorded (:func:`kernel_report`).
    """
    if not kernels_in_use():
        return []
    from tqbatch.testing.backend import kernel_check

    try:
        precision = matmul_precision()
    except BackendError:
        precision = "tf32"  # the looser bound; the failed measurement is reported on its own
    results = kernel_check.run(kernel_check.METAL, kernel_check.PLAIN, precision=precision)
    problems = [p for r in results for p in r.problems]
    record = {"retried_after": None}
    if problems and all(_PIPELINE_BUILD.search(p) for p in problems):
        record["retried_after"] = problems
        results = kernel_check.run(kernel_check.METAL, kernel_check.PLAIN, precision=precision)
        problems = [p for r in results for p in r.problems]
    record["cases"] = [
        {
            "case": str(r.case),
            "passed": not r.problems,
            "problems": list(r.problems),
            "seconds": round(r.seconds, 4),
        }
        for r in results
    ]
    record["passed"] = not problems
    _KERNEL_CHECKS[_device_type()] = record
    return problems


def _known_answers() -> list[str]:
    """Every known-answer computation that came out wrong, as sentences."""
    import mlx.core as mx
    import numpy as np

    problems = []

    def expect(name, got, want, atol=0.0):
        got = np.array(got)
        if got.shape != want.shape or not np.allclose(got, want, atol=atol, rtol=0):
            problems.append(f"{name}: got {got.ravel()[:4]}..., expected {want.ravel()[:4]}...")

    rng = np.random.default_rng(0)
    # Small integers are exact in float32 and in TF32: any difference is a fault.
    a = rng.integers(-8, 9, (64, 96)).astype(np.float32)
    b = rng.integers(-8, 9, (96, 80)).astype(np.float32)
    expect("integer matmul", mx.array(a) @ mx.array(b), a @ b)
    expect("batched integer matmul", mx.array(a)[None] @ mx.array(b)[None], (a @ b)[None])
    words = rng.integers(0, 2**16, 64).astype(np.uint32)
    expect(
        "bit packing",
        (mx.array(words) << 7) | (mx.array(words) >> 3) & 5,
        (words << 7) | (words >> 3) & 5,
    )
    table = rng.standard_normal(16).astype(np.float32)
    index = rng.integers(0, 16, (8, 32)).astype(np.uint8)
    expect("gather", mx.array(table)[mx.array(index)], table[index])
    expect("reduction", mx.sum(mx.array(a), axis=1), a.sum(axis=1))
    sylvester = np.array([[1.0]])
    for _ in range(3):
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    # Entries are +-8**-0.5: one rounding of the scale, well inside 1e-6.
    expect("hadamard", mx.hadamard_transform(mx.eye(8)), sylvester * 8**-0.5, atol=1e-6)
    # Fused attention over integer-valued operands: scores are exact, so only
    # exp/normalisation rounding remains (1e-5 relative; TF32 rounds nothing here).
    q = rng.integers(-2, 3, (1, 2, 3, 16)).astype(np.float32)
    k = rng.integers(-2, 3, (1, 2, 5, 16)).astype(np.float32)
    v = rng.integers(-2, 3, (1, 2, 5, 16)).astype(np.float32)
    s = q @ k.transpose(0, 1, 3, 2) * 0.25
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    got = mx.fast.scaled_dot_product_attention(
        mx.array(q), mx.array(k), mx.array(v), scale=0.25, mask=None
    )
    expect("fused attention", got, want, atol=1e-4)
    if not problems and not np.any(np.array(got)):
        problems.append("fused attention returned all zeros")
    return problems + _kernel_problems()


def check_backend(precision: str | None = None) -> dict:
    """Run the known-answer check on the default device; returns :func:`describe`.

    Raises ``BackendError`` naming every wrong answer, or when the measured
    matmul precision differs from ``precision`` (default: the requested one).
    A request for TF32 on a device that has none (the CPU) is not an error:
    it computes float32, which :func:`describe` reports.
    """
    problems = _known_answers()
    wanted = precision or requested_precision()
    try:
        measured = matmul_precision()
    except BackendError as exc:
        problems.append(str(exc))
        measured = None
    if measured == "tf32" and wanted == "float32":
        problems.append(
            "float32 was requested but matmuls run at TF32: MLX_ENABLE_TF32=0 was set after "
            "MLX first read it; set it in the environment before starting"
        )
    if problems:
        raise BackendError(
            f"the {_device_type()} backend ({_device_name()}) failed the known-answer check, "
            "so no cache verdict would be trustworthy:\n  " + "\n  ".join(problems)
        )
    return describe()


def describe() -> dict:
    """What a report or a saved failure records about the backend."""
    try:
        mlx_version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        mlx_version = "unknown"
    return {
        "mlx": mlx_version,
        "device": _device_type(),
        "device_name": _device_name(),
        "precision": requested_precision(),
        "matmul_precision": matmul_precision(),
        "kernels": _kernels(),
        "lane": lane.describe(),
    }


def kernel_report() -> dict | None:
    """The kernel check this process ran on the current device, or None where none ran."""
    return _KERNEL_CHECKS.get(_device_type())


def device_memory() -> dict:
    """The device's memory as MLX reports it (bytes): size and recommended working set."""
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - older or partial builds: nothing to report
        return {}
    keys = ("memory_size", "max_recommended_working_set_size", "max_buffer_length")
    return {key: int(info[key]) for key in keys if key in info}


def _kernels() -> str:
    """The custom kernels the cache's codec runs here, and whether this process checked them."""
    if not kernels_in_use():
        return f"none (plain MLX ops; mlx-vlm: {lane.describe()['mlx_vlm_metal']})"
    check = kernel_report()
    if check is None:
        return "mlx-vlm metal (not checked)"
    retried = ", after one retry of a failed pipeline build" if check["retried_after"] else ""
    return f"mlx-vlm metal ({'checked' if check['passed'] else 'failed'}{retried})"


def describe_line(info: dict | None = None) -> str:
    """:func:`describe` as one line for report headers."""
    info = info or describe()
    lane_info = info.get("lane") or {}
    launched = lane_info.get("kernels_launched")
    return (
        f"mlx {info['mlx']} on {info['device']} ({info['device_name']}), "
        f"float32 matmuls at {info['matmul_precision']} ({TF32_VARIABLE}="
        f"{'0' if info['precision'] == 'float32' else '1'}), "
        f"lane {lane_info.get('lane', 'not recorded')}, "
        f"kernels: {info.get('kernels', 'not recorded')}"
        + (f", launched so far: {_launch_counts(launched)}" if launched is not None else "")
    )


def _launch_counts(launched: dict[str, int]) -> str:
    if not launched:
        return "none"
    return f"{sum(launched.values())} ({len(launched)} kernels)"
