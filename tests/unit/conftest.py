"""Fixtures of the unit tests (helpers live in ``support``)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: reproducible and distinct per test."""
    seed = sum(request.node.nodeid.encode()) * 7919 % (2**32)
    return np.random.default_rng(seed)


@pytest.fixture
def batch(rng):
    """A non-empty B=3 ``Lockstep`` batch with left padding and spare capacity."""
    from .support import Lockstep

    ls = Lockstep.merge([5, 2, 3], rng)
    ls.update(rng, 1)
    return ls
