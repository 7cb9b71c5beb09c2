"""Shared, expensive fixtures of the end-to-end tests: one model, one set of references."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tqbatch.testing.target import load_impl
from tqbatch.workbench.e2e import ModelSpec, build_model, run_scenario, scenario_references

SPEC = ModelSpec()  # 4 layers, hidden 256, 4 query / 2 KV heads, head_dim 64
# A cheaper model for the seed sweep and the forward-noise comparison: two
# TurboQuant layers, so the second one's inputs carry forward noise.
SMALL_SPEC = ModelSpec(seed=2, num_layers=3)
BITS = 4.0
SEED = 0

MATRIX_DOC = Path(__file__).resolve().parents[2] / "docs" / "model-families.md"


def doc_matrix(marker: str) -> dict[tuple[str, str], dict[str, str]]:
    """docs/model-families.md's table between ``<!-- MARKER:start/end -->``:
    (family, scenario) -> {column: status word}."""
    text = MATRIX_DOC.read_text()
    block = text[text.index(f"<!-- {marker}:start -->") : text.index(f"<!-- {marker}:end -->")]
    lines = [line for line in block.splitlines() if line.startswith("|")]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    table = {}
    for line in lines[2:]:
        values = [v.strip() for v in line.strip("|").split("|")]
        table[values[0], values[1]] = {
            column: re.match(r"PASS|FAIL|ERROR|N/A", value).group(0)
            for column, value in zip(header[2:], values[2:])
        }
    return table


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
