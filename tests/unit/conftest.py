"""Fixtures of the unit tests (helpers live in ``support``)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: reproducible and distinct per test."""
    seed = sum(request.node.nodeid.encode()) * 7919 % (2**32)
    return np.random.default_rng(seed)
