"""Shared, expensive fixtures of the end-to-end tests: one model, one set of references."""

from __future__ import annotations

import pytest

from tqbatch.e2e import ModelSpec, build_model, run_scenario, scenario_references
from tqbatch.testing.impl import load_impl

SPEC = ModelSpec()  # 4 layers, hidden 256, 4 query / 2 KV heads, head_dim 64
BITS = 4.0
SEED = 0


@pytest.fixture(scope="session")
def model():
    return build_model(SPEC)


@pytest.fixture(scope="session")
def references(model):
    return scenario_references(model, SPEC, bits=BITS, seed=SEED)


@pytest.fixture(scope="session")
def impl():
    """The batch cache under test: --impl / $TQBATCH_IMPL, else tqbatch's own."""
    return load_impl()


@pytest.fixture(scope="session")
def scenario(model, references, impl):
    return run_scenario(
        SPEC, bits=BITS, seed=SEED, model=model, references=references, batch_cache_class=impl
    )
