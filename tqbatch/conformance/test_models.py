"""The model-family matrix, against the cache under test (opt-in: ``--tqbatch-models``)."""

from __future__ import annotations

import pytest

from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.gate import plugin
from tqbatch.testing.gate.session import conclude, spec


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "model_cell" not in metafunc.fixturenames:
        return
    if plugin.harness(metafunc.config).models:
        from tqbatch.workbench import model_matrix, vlm_families

        cells = [(f, s) for f in vlm_families.FAMILIES for s in model_matrix.SCENARIOS]
        metafunc.parametrize("model_cell", cells, ids=[f"{f}-{s}" for f, s in cells])
    else:
        off = pytest.mark.skip(reason="the model-family matrix is opt-in: --tqbatch-models")
        metafunc.parametrize("model_cell", [pytest.param(None, marks=off)], ids=["off"])


def test_model_family(model_cell, tqbatch_harness, request):
    """The cache passes, inside mlx-vlm's model code, wherever mlx-lm's BatchKVCache passes."""
    from tqbatch.workbench import model_matrix

    state = tqbatch_harness
    family, scenario = model_cell
    if state.impl.__module__.startswith("tqbatch.cache"):
        target = model_matrix.target_for("tqbatch")
    else:
        target = model_matrix.Target(spec(state), state.impl)
    cell = model_matrix.run_cell(family, scenario, target)
    if cell.status in ("N/A", "NONDET"):
        pytest.skip(f"{cell.status}: {cell.detail}")
    if cell.status == "PASS":
        return
    baseline = model_matrix.run_cell(
        family, scenario, model_matrix.target_for(model_matrix.BASELINE)
    )
    if baseline.status != "PASS":
        pytest.skip(
            f"{model_matrix.BASELINE} does not pass here either ({baseline.short()}): the "
            f"limitation is below the cache; {cell.short()}"
        )
    found = Failure(level="contract", what=f"{family} / {scenario}: {cell.short()}")
    conclude(request, state, [found])
