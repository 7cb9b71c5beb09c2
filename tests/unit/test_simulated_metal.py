"""The simulated Mac (``tqbatch.testing.backend.simulated_metal``): patches, MLX's dispatch, modes.

Every test uninstalls its simulator on the way out (the ``simulate`` fixture),
which also empties mlx-vlm's kernel-builder caches, so later tests in the same
process see this machine's real MLX: no Metal, mlx-vlm's plain fallbacks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm import turboquant

from tqbatch.testing.backend import kernel_check
from tqbatch.testing.backend.simulated_metal import (
    LOG_VARIABLE,
    VARIABLE,
    Launch,
    SimulatedMetal,
    install_from_environment,
    read_launch_log,
)

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "tests" / "simulated_mac"
PATCHED = (
    (mx.metal, "is_available"),
    (mx.metal, "device_info"),
    (mx, "is_available"),
    (mx, "device_count"),
    (mx, "set_default_device"),
    (mx, "default_device"),
    (mx, "device_info"),
    (mx.fast, "metal_kernel"),
)
MISSING = object()

pytestmark = pytest.mark.skipif(mx.metal.is_available(), reason="a real Metal is present")


@pytest.fixture
def simulate():
    """Installs simulators for a test; uninstalls them whatever the test did."""
    made = []

    def make(*args, **kwargs) -> SimulatedMetal:
        # Uncounted: the suite's report of launched kernels is the suite's own.
        simulator = SimulatedMetal(*args, **{"counted": False, **kwargs})
        made.append(simulator)
        return simulator.install()

    try:
        yield make
    finally:
        for simulator in reversed(made):
            simulator.uninstall()


@pytest.fixture
def mlx_vlm_gate(monkeypatch):
    # A CPU-lane session (TQBATCH_DEVICE=cpu) keeps mlx-vlm's Metal gate closed
    # for the process; these tests play a Mac on the GPU lane, so they take
    # mlx-vlm's own gate back for their duration.
    monkeypatch.setattr(
        turboquant, "_metal_available", lambda: hasattr(mx, "metal") and mx.metal.is_available()
    )


def _probe(**kwargs):
    """A one-output kernel no emulation knows, launched once."""
    kernel = mx.fast.metal_kernel(
        name="probe", input_names=["a"], output_names=["out"], source="out[0] = a[0];"
    )
    return kernel(
        inputs=[mx.arange(12, dtype=mx.float32).reshape(3, 4)],
        output_shapes=[(3, 4)],
        output_dtypes=[mx.float16],
        grid=(12, 1, 1),
        threadgroup=(12, 1, 1),
        **kwargs,
    )


# ------------------------------------------------------------ patch and restore


def test_uninstall_restores_every_patched_attribute_exactly(simulate):
    before = {(id(o), a): getattr(o, a, MISSING) for o, a in PATCHED}
    simulator = simulate("zeros")
    for owner, attribute in PATCHED:
        assert getattr(owner, attribute) is not before[(id(owner), attribute)], attribute
    assert mx.metal.is_available() and mx.is_available(mx.gpu) and mx.device_count(mx.gpu) == 1
    simulator.uninstall()
    for owner, attribute in PATCHED:
        assert getattr(owner, attribute, MISSING) is before[(id(owner), attribute)], attribute
    assert not mx.metal.is_available() and not mx.is_available(mx.gpu)


def test_absent_mode_removes_the_factory_and_puts_it_back(simulate):
    factory = mx.fast.metal_kernel
    simulator = simulate("absent")
    assert mx.metal.is_available() and not hasattr(mx.fast, "metal_kernel")
    with pytest.raises(AttributeError):
        _probe()
    assert simulator.launches == []
    simulator.uninstall()
    assert mx.fast.metal_kernel is factory


def test_a_mac_default_device_and_device_info(simulate):
    simulate("zeros", working_set=3 * 2**30, default_device="gpu")
    assert mx.default_device() == mx.gpu and mx.default_device().type == mx.DeviceType.gpu
    info = mx.device_info()
    assert info["device_name"] == "Apple Paravirtual device (simulated)"
    assert info["max_recommended_working_set_size"] == 3 * 2**30
    assert {"architecture", "memory_size", "max_buffer_length", "resource_limit"} <= set(info)
    assert mx.device_info(mx.gpu) == info == mx.metal.device_info()
    mx.set_default_device(mx.cpu)
    assert mx.default_device() == mx.cpu
    assert mx.device_info()["device_name"] != info["device_name"]  # the real CPU's
    mx.set_default_device(mx.gpu)
    assert mx.default_device() == mx.gpu


def test_installing_does_not_import_mlx():
    code = (
        "import sys\n"
        "from tqbatch.testing.backend.simulated_metal import SimulatedMetal\n"
        "SimulatedMetal('zeros').install()\n"
        "assert not any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules)\n"
        "import mlx.core as mx\n"
        "assert mx.metal.is_available() and mx.default_device() == mx.gpu\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TQBATCH_DEVICE", VARIABLE)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=120)


def test_a_second_simulator_is_refused(simulate):
    simulate("zeros")
    with pytest.raises(RuntimeError, match="already installed"):
        SimulatedMetal("pass").install()


# ------------------------------------------------------------ MLX's dispatch rules


def test_rule_032_runs_a_streamless_kernel_on_the_gpu_whatever_the_default(simulate):
    simulator = simulate("zeros", rule="0.32", default_device="gpu")
    mx.set_default_device(mx.cpu)
    _probe()
    assert simulator.launches[-1].device == "gpu"
    with pytest.raises(ValueError, match=r"^\[metal_kernel\] Only supports the GPU\.$"):
        _probe(stream=mx.cpu)
    assert simulator.launches[-1].device == "cpu"
    assert simulator.launches[-1].outcome == "wrong-device"
    _probe(stream=mx.gpu)
    assert simulator.launches[-1].device == "gpu"


def test_rule_031_runs_a_streamless_kernel_on_the_default_device(simulate):
    simulator = simulate("zeros", rule="0.31", default_device="gpu")
    _probe()
    assert simulator.launches[-1].device == "gpu"
    mx.set_default_device(mx.cpu)
    with pytest.raises(ValueError, match=r"^\[metal_kernel\] Only supports the GPU\.$"):
        _probe()
    assert simulator.launches[-1] == Launch("probe", "cpu", "wrong-device")
    _probe(stream=mx.gpu)
    assert simulator.launches[-1].device == "gpu"


# ------------------------------------------------------------ modes


def test_zeros_mode_answers_zeros_of_the_requested_shapes_and_dtypes(simulate):
    simulator = simulate("zeros")
    (out,) = _probe()
    assert out.shape == (3, 4) and out.dtype == mx.float16 and not np.any(np.array(out))
    assert [(launch.kernel, launch.outcome) for launch in simulator.launches] == [
        ("probe", "zeros")
    ]


def test_raise_mode_raises_mlx_metal_build_errors(simulate):
    simulate("raise")
    with pytest.raises(RuntimeError) as raised:
        _probe()
    # MLX names the instantiation: the kernel, then its input and output types.
    assert str(raised.value).startswith(
        "[metal::Device] Unable to load kernel custom_kernel_probe_float_float16_t\n"
    )


def test_raise_mode_can_fail_the_library_build(simulate):
    simulate("raise", failure="library")
    with pytest.raises(RuntimeError, match=r"Unable to build metal library from source"):
        _probe()


def test_flaky_mode_fails_the_first_build_once_then_passes(simulate):
    simulator = simulate("flaky")
    with pytest.raises(RuntimeError, match="Unable to load kernel"):
        _probe()
    # The second launch builds: "pass", and the probe has no emulation.
    with pytest.raises(NotImplementedError, match="'probe'"):
        _probe()
    assert [launch.outcome for launch in simulator.launches] == ["build-failed", "not-emulated"]


def test_pass_mode_names_a_kernel_without_emulation(simulate):
    simulator = simulate("pass")
    with pytest.raises(NotImplementedError, match="no emulation of kernel 'probe'"):
        _probe()
    assert simulator.launches[-1].outcome == "not-emulated"


def test_refuse_mode_refuses_every_launch(simulate):
    simulator = simulate("refuse")
    with pytest.raises(RuntimeError, match="^simulated Metal refused a kernel launch: probe$"):
        _probe()
    assert simulator.launches[-1].outcome == "refused"


def test_a_kernel_kept_past_uninstall_fails_loudly(simulate):
    simulator = simulate("zeros")
    kernel = mx.fast.metal_kernel(name="kept", input_names=["a"], output_names=["o"], source="")
    simulator.uninstall()
    with pytest.raises(RuntimeError, match="after its simulator was uninstalled"):
        kernel(
            inputs=[mx.zeros(1)],
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
        )


def test_mlx_vlm_builders_are_forgotten_on_install_and_uninstall(simulate, mlx_vlm_gate):
    assert turboquant._pack_lowbit_kernel() is None  # cached: no Metal here
    simulate("zeros")
    assert turboquant._pack_lowbit_kernel() is not None
    SimulatedMetal._active.uninstall()
    assert turboquant._pack_lowbit_kernel() is None


# ------------------------------------------------------------ subprocesses and the log


def _simulated_python(code: str, tmp_path, spec: str, lane: str | None = None):
    log = tmp_path / "launches.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TQBATCH_DEVICE"}
    env.update({VARIABLE: spec, LOG_VARIABLE: str(log)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    if lane:
        env["TQBATCH_DEVICE"] = lane
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    return done, read_launch_log(log)


QUANTIZE = (
    "import mlx.core as mx\n"
    "from mlx_vlm.turboquant import _TurboQuantMSECodec\n"
    "mx.eval(_TurboQuantMSECodec(64, 4, 0).quantize(mx.ones((1, 1, 2, 64))))\n"
)


def test_a_subprocess_on_a_simulated_mac_logs_each_launch(tmp_path):
    done, log = _simulated_python(QUANTIZE, tmp_path, "zeros:0.32")
    assert done.returncode == 0, done.stderr
    assert [(e["kernel"], e["device"], e["outcome"]) for e in log] == [
        ("turboquant_norot_quantize_4", "gpu", "zeros")
    ]
    assert log[0]["pid"] != os.getpid()


def test_a_crashing_subprocess_has_already_logged_its_launches(tmp_path):
    done, log = _simulated_python(QUANTIZE + "import os; os._exit(7)\n", tmp_path, "zeros")
    assert done.returncode == 7
    assert [e["kernel"] for e in log] == ["turboquant_norot_quantize_4"]


def test_the_cpu_lane_launches_no_metal_kernel_on_a_simulated_mac(tmp_path):
    done, log = _simulated_python(QUANTIZE, tmp_path, "refuse", lane="cpu")
    assert done.returncode == 0, done.stderr
    assert log == []


# ------------------------------------------------------------ the backend's kernel check


@pytest.fixture
def mac(simulate, mlx_vlm_gate):
    """A simulated Mac on the GPU lane, installed before mlx-vlm's kernels are next built."""
    return lambda mode: simulate(mode, default_device="gpu")


def test_kernel_check_sees_zeros_in_every_case(mac):
    simulator = mac("zeros")
    found = kernel_check.problems(kernel_check.METAL, kernel_check.PLAIN)
    for case in kernel_check.CASES:
        assert any(p.startswith(str(case)) for p in found), case
    assert {launch.outcome for launch in simulator.launches} == {"zeros"}


def test_kernel_check_sees_the_build_error_in_every_case(mac):
    mac("raise")
    found = kernel_check.problems(kernel_check.METAL, kernel_check.PLAIN)
    assert len(found) == len(kernel_check.CASES)
    for case, problem in zip(kernel_check.CASES, found):
        assert problem.startswith(f"{case}: raised RuntimeError: [metal::Device] Unable to load")


def test_kernel_check_passes_on_emulated_kernels_that_really_launch(mac):
    simulator = mac("pass")
    assert kernel_check.problems(kernel_check.METAL, kernel_check.PLAIN) == []
    launched = {launch.kernel for launch in simulator.launches}
    assert {launch.outcome for launch in simulator.launches} == {"emulated"}
    assert launched == {
        "turboquant_norot_quantize_4",
        "turboquant_fused_kv_quantize_k4_v4",
        "turboquant_unpack_lowbit",
        "turboquant_fused_mse_sdpa_k4_v4_d64",
        "turboquant_mse_sdpa_2pass1_k4_v4_d64",
        "turboquant_mse_sdpa_2pass2",
        "turboquant_mse_score_tiled_1",
        "turboquant_mse_score_tiled_2",
        "turboquant_mse_scores_weighted_rot_sum_repeat_2",
        "turboquant_mse_weighted_rot",
        "turboquant_single_tile_value_4_r2",
    }


def test_flaky_mode_passes_a_real_kernel_on_its_second_launch(mac):
    simulator = mac("flaky")
    codec = turboquant._TurboQuantMSECodec(64, 4, 0)
    x = mx.ones((1, 1, 2, 64))
    with pytest.raises(RuntimeError, match="Unable to load kernel custom_kernel_turboquant_norot"):
        mx.eval(codec.quantize(x))
    mx.eval(codec.quantize(x))
    assert [launch.outcome for launch in simulator.launches] == ["build-failed", "emulated"]


# ------------------------------------------------------------ emulations against plain fallbacks


def _fallback_and_emulated(mac, step):
    """``step()`` through mlx-vlm's plain fallbacks (no Metal), then through emulated kernels."""
    want = step()
    mx.eval(want)
    simulator = mac("pass")
    got = step()
    mx.eval(got)
    assert simulator.launches, "no kernel was launched"
    assert {launch.outcome for launch in simulator.launches} == {"emulated"}
    return want, got, {launch.kernel for launch in simulator.launches}


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_packing_kernels_write_mlx_vlm_bits(mac, rng, bits):
    codes = mx.array(rng.integers(0, 2**bits, (7, 80)).astype(np.uint32))

    def step():
        packed = turboquant._pack_lowbit(codes, bits)
        return packed, turboquant._unpack_lowbit(packed, bits, 80)

    want, got, kernels = _fallback_and_emulated(mac, step)
    assert kernels == {"turboquant_pack_lowbit", "turboquant_unpack_lowbit"}
    assert np.array_equal(np.array(got[0]), np.array(want[0]))
    assert np.array_equal(np.array(got[1]), np.array(codes))


def _same_states(got, want) -> None:
    assert np.array_equal(np.array(got.indices), np.array(want.indices))
    assert np.allclose(np.array(got.norms), np.array(want.norms), rtol=2**-10, atol=0)


@pytest.mark.parametrize(("dim", "bits"), [(64, 3), (96, 4), (80, 2)])
def test_the_quantize_kernel_chooses_mlx_vlm_codes(mac, rng, dim, bits):
    codec = turboquant._TurboQuantMSECodec(dim, bits, 0)
    tokens, _ = kernel_check.far_from_midpoints(codec, (1, 2, 3), rng)
    want, got, kernels = _fallback_and_emulated(mac, lambda: codec.quantize(tokens))
    assert kernels == {f"turboquant_norot_quantize_{bits}"}
    _same_states(got, want)


@pytest.mark.parametrize(("dim", "bits"), [(96, 4), (80, 3), (48, 2)])
def test_the_fused_key_value_kernel_chooses_mlx_vlm_codes(mac, rng, dim, bits):
    key_codec = turboquant._TurboQuantMSECodec(dim, bits, 0)
    value_codec = turboquant._TurboQuantMSECodec(dim, bits, 1)
    assert not key_codec.use_rht  # the fused kernel serves dense rotations only
    keys, _ = kernel_check.far_from_midpoints(key_codec, (1, 2, 1), rng)
    values, _ = kernel_check.far_from_midpoints(value_codec, (1, 2, 1), rng)
    want = (key_codec.quantize(keys), value_codec.quantize(values))
    mx.eval(want)
    simulator = mac("pass")
    cache = turboquant.TurboQuantKVCache(bits=bits)
    cache.key_codec, cache.value_codec = key_codec, value_codec
    got = cache._try_fused_kv_quantize(keys, values)
    assert [launch.kernel for launch in simulator.launches] == [
        f"turboquant_fused_kv_quantize_k{bits}_v{bits}"
    ]
    _same_states(got[0], want[0])
    _same_states(got[1], want[1])


@pytest.mark.parametrize(
    ("dim", "bits", "tokens", "heads", "masked"),
    [
        (64, 4, 5, (2, 4), False),  # fused single pass
        (64, 3, 40, (1, 1), False),  # fused, codes crossing bytes
        (96, 2, 2050, (2, 6), False),  # two passes
        (64, 4, 5, (2, 4), True),  # chunked: scores, then the weighted sum of 2 repeats
        (64, 3, 6, (2, 2), True),  # chunked: one repeat
        (80, 4, 5, (2, 4), False),  # separate score and value kernels
    ],
)
@pytest.mark.float32_only(
    reason="the emulated kernels sum in float32 and are held to rtol 1e-4 of mlx-vlm's "
    "fallbacks, whose matmuls run at TF32 there (seen on an H100: 6.5e-4 on an output of 0.13)"
)
def test_decode_kernels_attend_as_mlx_vlm_fallbacks_do(mac, rng, dim, bits, tokens, heads, masked):
    kv_heads, q_heads = heads
    key_codec = turboquant._TurboQuantMSECodec(dim, bits, 0)
    value_codec = turboquant._TurboQuantMSECodec(dim, bits, 1)
    shape = (2, kv_heads, tokens, dim)
    keys = key_codec.quantize(mx.array(rng.standard_normal(shape).astype(np.float32)))
    values = value_codec.quantize(mx.array(rng.standard_normal(shape).astype(np.float32)))
    queries = mx.array(rng.standard_normal((2, q_heads, 1, dim)).astype(np.float32))
    mask = mx.array(np.arange(tokens) > 0)[None, None, None] if masked else None
    cache = turboquant.TurboQuantKVCache(bits=bits)
    cache.key_codec, cache.value_codec = key_codec, value_codec

    def step():
        return cache.decode_attention(queries, keys, values, scale=dim**-0.5, mask=mask)

    want, got, _ = _fallback_and_emulated(mac, step)
    assert got.shape == want.shape
    assert np.allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("repeats", [1, 3])
def test_codec_score_and_weighted_sum_kernels_match_mlx_vlm_fallbacks(mac, rng, repeats):
    codec = turboquant._TurboQuantMSECodec(96, 3, 0)
    state = codec.quantize(mx.array(rng.standard_normal((2, 2, 7, 96)).astype(np.float32)))
    queries = mx.array(rng.standard_normal((2, 2, repeats, 1, 96)).astype(np.float32))
    scores = mx.array(rng.standard_normal((2, 2, repeats, 1, 7)).astype(np.float32))

    def step():
        q_rot = codec.prepare_queries(queries)
        untiled = turboquant._mse_score_kernel()  # mlx-vlm prefers the tiled one
        untiled_scores = (
            untiled
            and untiled(
                inputs=[
                    q_rot.reshape(2, 2, repeats, 96),
                    state.norms,
                    state.indices,
                    codec.codebook,
                ],
                template=[("Dim", 96), ("Bits", 3), ("PackedWidth", state.indices.shape[-1])],
                grid=(32, repeats, 2 * 2 * 7),
                threadgroup=(32, 1, 1),
                output_shapes=[(2, 2, repeats, 7)],
                output_dtypes=[mx.float32],
            )[0][:, :, :, None]
        )
        return (
            codec.score_prepared(q_rot, state),
            untiled_scores,
            codec.weighted_sum(mx.softmax(scores, axis=-1), state),
            codec.weighted_sum_from_scores(scores, state),
        )

    want, got, kernels = _fallback_and_emulated(mac, step)
    assert want[1] is None  # no Metal: no kernel
    expected = [want[0], want[0], want[2], want[3]]
    for g, w in zip(got, expected):
        assert np.allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-5)
    tiled = {f"turboquant_mse_score_tiled_{repeats}", "turboquant_mse_score"}
    if repeats == 1:
        assert kernels == tiled | {"turboquant_mse_weighted_rot"}
    else:
        assert kernels == tiled | {
            "turboquant_mse_weighted_rot_repeat_3",
            "turboquant_mse_scores_weighted_rot_repeat_3",
        }


def test_the_lane_still_counts_launches_on_a_simulated_mac(tmp_path):
    # In a subprocess: the suite's own count of launched kernels stays its own.
    code = QUANTIZE + "from tqbatch.testing.backend import lane\nprint(lane.launched())\n"
    done, log = _simulated_python(code, tmp_path, "zeros")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'turboquant_norot_quantize_4': 1}"
    assert len(log) == 1


@pytest.mark.parametrize("text", ["", "pass:0.30", "green", "zeros:"])
def test_the_environment_variable_is_mode_or_mode_and_rule(monkeypatch, text):
    monkeypatch.setenv(VARIABLE, text)
    if text in ("", "zeros:"):
        simulator = install_from_environment()
        try:
            assert simulator is None if not text else simulator.mode == "zeros"
            assert install_from_environment() is simulator  # idempotent
        finally:
            if simulator is not None:
                simulator.uninstall()
    else:
        with pytest.raises(ValueError, match="expected MODE or MODE:RULE"):
            install_from_environment()


def test_on_a_simulated_mac_a_decode_step_never_reaches_the_cuda_kernel(mac, rng, monkeypatch):
    # The fused CUDA decode kernel is the default (auto) where MLX's default device
    # is a CUDA GPU; a Mac's default device is a GPU too, but Metal: the cache's
    # decode step must keep its Metal path there, with the kernel never reached.
    from tqbatch import _cuda_decode

    from .support import cache_decode_step, forbid_cuda_kernel

    forbid_cuda_kernel(monkeypatch)  # a Mac has no CUDA
    monkeypatch.delenv("TQBATCH_DECODE_KERNEL", raising=False)
    simulator = mac("pass")
    assert mx.default_device() == mx.Device(mx.gpu) and _cuda_decode.mode() == "auto"
    assert not _cuda_decode.available()
    cache, q, ks, vs, mask = cache_decode_step(rng)
    out = cache.decode_attention(q, ks, vs, scale=0.125, mask=mask)
    mx.eval(out)
    assert out.shape == (2, 4, 1, 64) and np.all(np.isfinite(np.array(out)))
    assert all(launch.outcome == "emulated" for launch in simulator.launches)
