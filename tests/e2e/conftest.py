"""Shared, expensive fixtures of the end-to-end tests: one model, one set of references."""

from __future__ import annotations

import pytest

from tqbatch.testing.impl import load_impl
from tqbatch.workbench.e2e import ModelSpec, build_model, run_scenario, scenario_references

SPEC = ModelSpec()  # 4 layers, hidden 256, 4 query / 2 KV heads, head_dim 64
# A cheaper model for the seed sweep and the forward-noise comparison: two
# TurboQuant layers, so the second one's inputs carry forward noise.
SMALL_SPEC = ModelSpec(seed=2, num_layers=3)
BITS = 4.0
SEED = 0


@pytest.fixture(scope="session")
def prepared():
    """``prepared(spec)``: (model, references) for a ModelSpec, built once per session."""
    built = {}

    def get(spec: ModelSpec):
        if spec not in built:
            model = build_model(spec)
            built[spec] = model, scenario_references(model, spec, bits=BITS, seed=SEED)
        return built[spec]

    return get


@pytest.fixture(scope="session")
def model(prepared):
    return prepared(SPEC)[0]


@pytest.fixture(scope="session")
def references(prepared):
    return prepared(SPEC)[1]


@pytest.fixture(scope="session")
def impl():
    """The batch cache under test: --impl / $TQBATCH_IMPL, else tqbatch's own."""
    return load_impl()


@pytest.fixture(scope="session")
def scenario(model, references, impl):
    return run_scenario(
        SPEC, bits=BITS, seed=SEED, model=model, references=references, batch_cache_class=impl
    )
