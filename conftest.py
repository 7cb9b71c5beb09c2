"""Root pytest configuration: Hypothesis profiles and the harness target."""

from __future__ import annotations

import os

from hypothesis import settings

from tqbatch.testing.profiles import default_profile, register_profiles

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


def pytest_configure(config):
    impl = config.getoption("--impl")
    if impl:
        # One source of truth for the target: the harness reads TQBATCH_IMPL.
        os.environ["TQBATCH_IMPL"] = impl
