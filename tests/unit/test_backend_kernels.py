"""The backend check's part for mlx-vlm's Metal kernels (``tqbatch.testing.backend.kernel_check``).

No Metal kernel runs here (the CPU): the comparison is tested by passing the
kernel path in. The plain path against itself and mlx-vlm's entry points
(their plain fallbacks off Metal) must pass; a path returning zeros, raising,
or slightly wrong (one code flipped, a norm or an output 1 % off) must be named.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import mlx.core as mx
import mlx_vlm.turboquant as turboquant
import numpy as np
import pytest
from mlx_vlm.turboquant import TurboQuantMSEState, _TurboQuantMSECodec

from tqbatch import _codec
from tqbatch.testing import backend
from tqbatch.testing.backend import kernel_check
from tqbatch.testing.backend.kernel_check import CASES, METAL, PLAIN, CodecPath

METAL_HERE = backend.kernels_in_use()


def _zero_state(codec, tokens):
    width = (codec.dim * codec.bits + 31) // 32
    return TurboQuantMSEState(
        mx.zeros(tokens.shape[:-1], dtype=mx.float16),
        mx.zeros((*tokens.shape[:-1], width), dtype=mx.uint32),
    )


# A device whose custom kernels return zeros (reported of GitHub's hosted macOS runners).
ZEROS = CodecPath(
    "zeros",
    write=lambda kc, vc, keys, values: (_zero_state(kc, keys), _zero_state(vc, values)),
    dequantize=lambda codec, state: mx.zeros((*state.norms.shape, codec.dim)),
    decode=lambda queries, *rest: mx.zeros(queries.shape),
)


def _flip_one_code(codec, state, token=0):
    codes = np.array(_codec.unpack(state.indices, codec.bits, codec.dim))
    codes[0, 0, token, 5] ^= 1
    return TurboQuantMSEState(state.norms, _codec.pack(mx.array(codes), codec.bits))


def _flipped_write(kc, vc, keys, values):
    k, v = PLAIN.write(kc, vc, keys, values)
    return _flip_one_code(kc, k), v


def _flipped_value_decode(queries, keys, values, kc, vc, scale, mask):
    # The last token: the masked cases hide the first.
    return PLAIN.decode(queries, keys, _flip_one_code(vc, values, token=-1), kc, vc, scale, mask)


def _norm_off_write(kc, vc, keys, values):
    k, v = PLAIN.write(kc, vc, keys, values)
    return TurboQuantMSEState((k.norms.astype(mx.float32) * 1.01).astype(mx.float16), k.indices), v


def test_the_plain_path_agrees_with_itself():
    assert kernel_check.problems(PLAIN, PLAIN) == []


def test_mlx_vlm_entry_points_agree_with_plain_ops():
    # Off Metal these are mlx-vlm's plain fallbacks, which checks that each
    # entry point is called as the cache calls it; on Metal, the check itself.
    precision = backend.matmul_precision()
    assert kernel_check.problems(METAL, PLAIN, precision=precision) == []


def test_a_kernel_path_returning_zeros_is_named_for_every_case():
    found = kernel_check.problems(ZEROS, PLAIN)
    for case in CASES:
        named = [p for p in found if p.startswith(str(case))]
        assert named and all("zeros" in p for p in named), (case, found)
        assert case.kernels in named[0]


@pytest.mark.parametrize(
    ("path", "steps", "says"),
    [
        (dataclasses.replace(PLAIN, write=_flipped_write), {"write"}, "1 of "),
        (dataclasses.replace(PLAIN, write=_norm_off_write), {"write"}, "more than one float16 ulp"),
        (
            dataclasses.replace(
                PLAIN, dequantize=lambda c, s: PLAIN.dequantize(c, _flip_one_code(c, s))
            ),
            {"dequantize"},
            "more than the rounding bound",
        ),
        (
            dataclasses.replace(PLAIN, decode=_flipped_value_decode),
            {"decode"},
            "more than the rounding bound",
        ),
        (
            dataclasses.replace(PLAIN, decode=lambda *a: PLAIN.decode(*a) * 1.01),
            {"decode"},
            "more than the rounding bound",
        ),
    ],
    ids=[
        "one code flipped",
        "a norm 1% off",
        "a read-out code flipped",
        "a decoded value code flipped",
        "decode 1% off",
    ],
)
def test_a_slightly_wrong_kernel_is_named(path, steps, says):
    found = kernel_check.problems(path, PLAIN, precision="float32")
    for case in CASES:
        named = [p for p in found if p.startswith(str(case))]
        if case.step not in steps:
            assert not named, named
        elif case.tokens <= 5:  # over 2050 tokens these are within the sum's rounding bound
            assert named and says in named[0], (case, found)
            assert "zeros" not in named[0]


def test_a_kernel_that_raises_is_named():
    def refuse(*args):
        raise ValueError("[metal_kernel] Only supports the GPU.")

    found = kernel_check.problems(CodecPath("refuses", refuse, refuse, refuse), PLAIN)
    assert len(found) == len(CASES)
    assert all("raised ValueError: [metal_kernel] Only supports the GPU." in p for p in found)


@pytest.mark.parametrize("dim", [64, 96])
def test_write_inputs_leave_no_rounding_choice(dim):
    """Each write check's tokens get the intended codes, MARGIN from every midpoint."""
    codec = _TurboQuantMSECodec(dim, kernel_check.BITS, kernel_check.SEED)
    tokens, codes = kernel_check.far_from_midpoints(codec, (1, 2, 6), np.random.default_rng(3))
    state = _codec.quantize_plain(codec, tokens)
    assert np.array_equal(np.array(_codec.unpack(state.indices, codec.bits, dim)), codes)
    x = np.array(tokens, dtype=np.float64)
    unit = x / np.linalg.norm(x, axis=-1, keepdims=True)
    rotated = np.array(codec._rotate_forward(mx.array(unit.astype(np.float32))), dtype=np.float64)
    distance = np.abs(rotated[..., None] - np.array(codec._midpoints, dtype=np.float64)).min()
    # float32 rounding of the round trip only (the suite's CPU computes float32).
    assert distance >= kernel_check.MARGIN - 1e-4


def test_case_labels_name_mlx_vlm_kernels():
    """A renamed kernel in a later mlx-vlm fails here, not silently in a label."""
    for case in CASES:
        names = re.findall(r"_\w+_kernel", case.kernels)
        assert names, case
        for name in names:
            assert callable(getattr(turboquant, name, None)), name


def test_check_backend_runs_the_kernel_check_where_metal_kernels_run(monkeypatch):
    monkeypatch.setattr(backend, "kernels_in_use", lambda: True)
    monkeypatch.setattr(backend, "_KERNEL_CHECKS", {})
    monkeypatch.setattr(kernel_check, "METAL", ZEROS)
    with pytest.raises(backend.BackendError, match="_fused_norot_quantize_kernel") as raised:
        backend.check_backend()
    assert "returned all zeros" in str(raised.value)
    assert backend.describe()["kernels"] == "mlx-vlm metal (failed)"
    report = backend.kernel_report()
    assert len(report["cases"]) == len(CASES) and not report["passed"]
    assert report["retried_after"] is None  # zeros are no pipeline build: no retry

    monkeypatch.setattr(kernel_check, "METAL", PLAIN)
    info = backend.check_backend()
    assert info["kernels"] == "mlx-vlm metal (checked)"
    assert "kernels: mlx-vlm metal (checked)" in backend.describe_line(info)
    assert all(case["passed"] and case["seconds"] >= 0 for case in backend.kernel_report()["cases"])


def test_a_failed_pipeline_build_is_retried_once_and_reported(monkeypatch):
    """The first attempt's build failure is recorded; a second that passes passes the check."""
    builds = {"failed": 0}

    def build_fails_once(*args):
        if builds["failed"] == 0:
            builds["failed"] += 1
            raise RuntimeError("[metal::Device] Unable to build metal library from source")
        return PLAIN.write(*args)

    flaky = kernel_check.CodecPath("flaky", build_fails_once, PLAIN.dequantize, PLAIN.decode)
    monkeypatch.setattr(backend, "kernels_in_use", lambda: True)
    monkeypatch.setattr(backend, "_KERNEL_CHECKS", {})
    monkeypatch.setattr(kernel_check, "METAL", flaky)
    info = backend.check_backend()
    assert info["kernels"] == "mlx-vlm metal (checked, after one retry of a failed pipeline build)"
    (first,) = backend.kernel_report()["retried_after"]
    assert "Unable to build metal library" in first

    # A build that fails every time fails the check after the one retry.
    def build_always_fails(*args):
        raise RuntimeError("[metal::Device] Unable to build metal library from source")

    broken = kernel_check.CodecPath("broken", build_always_fails, PLAIN.dequantize, PLAIN.decode)
    monkeypatch.setattr(kernel_check, "METAL", broken)
    with pytest.raises(backend.BackendError, match="Unable to build metal library"):
        backend.check_backend()
    assert backend.kernel_report()["retried_after"]


@pytest.mark.skipif(METAL_HERE, reason="Metal is present: the kernel check runs here")
def test_off_metal_no_kernel_check_runs(monkeypatch):
    def not_here(*args, **kwargs):
        raise AssertionError("the kernel check ran off Metal")

    monkeypatch.setattr(kernel_check, "run", not_here)
    info = backend.check_backend()
    assert info["kernels"].startswith("none (plain MLX ops")
    assert "kernels: none (plain MLX ops" in backend.describe_line(info)


@pytest.mark.skipif(METAL_HERE, reason="Metal is present: the kernel check runs here")
def test_off_metal_the_check_costs_no_mlx_vlm_import():
    code = (
        "import sys\n"
        "from tqbatch.testing import backend\n"
        "backend.select_precision('float32')\n"
        "backend.check_backend()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mlx_vlm', 'tqbatch.testing.k'))))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
