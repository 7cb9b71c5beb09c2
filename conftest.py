"""Root pytest configuration: the backend (precision, device), Hypothesis profiles, the target.

MLX reads ``MLX_ENABLE_TF32`` once, so the precision is chosen when this file
is imported: before pytest loads the ``conftest.py`` of a test directory named
on the command line (``tests/e2e/conftest.py`` imports mlx). ``--precision``
is read from the command line here for that reason; ``pytest_configure``
then confirms the parsed option agrees.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

from tqbatch.testing import backend
from tqbatch.testing.profiles import default_profile, register_profiles


def _precision_on_command_line() -> str | None:
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        if arg == "--precision" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--precision="):
            return arg.split("=", 1)[1]
    return None


backend.select_precision(_precision_on_command_line())

# The suite runs tqbatch commands, in-process and in subprocesses; under GitHub
# Actions each would append a summary of a test's run to the job's summary
# (tqbatch.commands.step_summary). Tests that check it set their own file.
os.environ.pop("GITHUB_STEP_SUMMARY", None)

register_profiles()
# Hypothesis's pytest plugin applies --hypothesis-profile after this, so the
# command-line option still wins over this default.
settings.load_profile(default_profile())


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        default=None,
        help="cache under test as module:Class (default: $TQBATCH_IMPL or tqbatch's own)",
    )
    parser.addoption(
        "--precision",
        choices=backend.PRECISIONS,
        default=None,
        help="float32 matmul precision: float32 (default; sets MLX_ENABLE_TF32=0) or tf32, "
        "the precision CUDA and Apple M5 GPUs serve with (default: $TQBATCH_PRECISION)",
    )
    parser.addoption(
        "--device",
        choices=backend.DEVICES,
        default=None,
        help="MLX default device (default: $TQBATCH_DEVICE, else MLX's own default)",
    )


@pytest.hookimpl(trylast=True)  # after Hypothesis's plugin has loaded --hypothesis-profile
def pytest_configure(config):
    if config.getoption("--hypothesis-seed", None) is not None and settings.default.derandomize:
        # A derandomized profile (ci) ignores --hypothesis-seed: asking for a
        # seed means asking for that seed's examples, so derandomize is dropped.
        settings.register_profile("seeded", settings(settings.default, derandomize=False))
        settings.load_profile("seeded")
    impl = config.getoption("--impl")
    if impl:
        # One source of truth for the target: the harness reads TQBATCH_IMPL.
        os.environ["TQBATCH_IMPL"] = impl
    backend.select_precision(config.getoption("--precision"))


def pytest_sessionstart(session):
    try:
        backend.select_device(session.config.getoption("--device"))
        session.config._tqbatch_backend = backend.check_backend()
    except (backend.BackendError, ValueError) as exc:
        # Cache verdicts on a backend that gets known answers wrong would be noise.
        pytest.exit(f"tqbatch: {exc}", returncode=3)


def pytest_runtest_setup(item):
    # A test that must resolve a difference finer than TF32 rounding (one
    # flipped code, a 1e-3 drift) says so; at TF32 it is skipped with why.
    marker = item.get_closest_marker("float32_only")
    if marker is not None and backend.matmul_precision() != "float32":
        pytest.skip(
            f"float32 only (matmuls here run at {backend.matmul_precision()}): "
            f"{marker.kwargs['reason']}"
        )


def pytest_report_header(config):
    info = getattr(config, "_tqbatch_backend", None)
    return f"tqbatch backend: {backend.describe_line(info)}" if info else None
