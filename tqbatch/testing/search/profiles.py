"""Hypothesis settings profiles for the harness.

Registered by the root ``conftest.py`` (and by the CLI); chosen with
Hypothesis's own ``--hypothesis-profile NAME``. ``ci`` is registered under
that exact name so that Hypothesis, which loads a profile called ``ci`` when
``CI`` is set, picks ours instead of its built-in one.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Every example touches MLX: codec tables take ~1 s to build on first use and
# CPU attention is slow, so wall-clock deadlines would only report noise.
_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

PROFILES = {
    # Fast feedback at a desk; failures are remembered in the local database.
    "dev": settings(max_examples=15, stateful_step_count=12, **_COMMON),
    # Deterministic and database-free, sized to keep `.ci/run` well inside
    # 90 minutes on 2 cores.
    # The state machine against tqbatch's cache took 89 s at 150 x 25 on an
    # idle 2-core machine (190 s on a busy one); 300 x 30 keeps the whole
    # default run near 10 minutes.
    "ci": settings(
        max_examples=300,
        stateful_step_count=30,
        derandomize=True,
        database=None,
        **_COMMON,
    ),
    # Long random campaigns; keeps found failures in the database.
    "nightly": settings(max_examples=2000, stateful_step_count=40, **_COMMON),
}


def register_profiles() -> None:
    for name, profile in PROFILES.items():
        settings.register_profile(name, profile)


def default_profile() -> str:
    return "ci" if os.environ.get("CI") else "dev"
