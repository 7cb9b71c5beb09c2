"""Root pytest configuration of tqbatch's own suite.

The harness's session setup is tqbatch's pytest plugin's
(``tqbatch.testing.gate.plugin``, installed as a ``pytest11`` entry point): the
precision and device, the backend's known-answer check (exit code 3), the
Hypothesis profiles registered, the report header. This file turns it on for
the suite (``plugin.activate``) and keeps what is the suite's own: ``--impl``,
``--precision`` and ``--device`` (the plugin's ``--tqbatch-impl``,
``--tqbatch-precision`` and ``--tqbatch-device`` under the names the suite has
always taken), the default Hypothesis profile loaded for every test (``ci``
when ``CI`` is set, else ``dev``) and the ``float32_only`` marker.

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
from tqbatch.testing.gate import plugin
from tqbatch.testing.search.profiles import default_profile, register_profiles


def _precision_on_command_line() -> str | None:
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        for option in ("--tqbatch-precision", "--precision"):
            if arg == option and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(f"{option}="):
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


def pytest_addoption(parser, pluginmanager):
    # The plugin comes with the install (its entry point); where tqbatch is
    # only on the path (PYTHONPATH, a staged machine) it is registered here.
    if not pluginmanager.has_plugin(plugin.NAME) and not pluginmanager.is_blocked(plugin.NAME):
        pluginmanager.register(plugin, plugin.NAME)
    parser.addoption(
        "--impl",
        default=None,
        help="cache under test as module:Class (default: $TQBATCH_IMPL or tqbatch's own; "
        "the suite's name for --tqbatch-impl)",
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
    if not config.pluginmanager.has_plugin(plugin.NAME):
        return  # turned off (-p no:tqbatch): no backend check either
    # The plugin checks the backend at the session's start (exit code 3 if it
    # fails) and reports it in the header.
    plugin.activate(
        config,
        impl=config.getoption("--impl"),
        precision=config.getoption("--precision"),
        device=config.getoption("--device"),
    )


def pytest_runtest_setup(item):
    # A test that must resolve a difference finer than TF32 rounding (one
    # flipped code, a 1e-3 drift) says so; at TF32 it is skipped with why.
    marker = item.get_closest_marker("float32_only")
    if marker is not None and backend.matmul_precision() != "float32":
        pytest.skip(
            f"float32 only (matmuls here run at {backend.matmul_precision()}): "
            f"{marker.kwargs['reason']}"
        )
