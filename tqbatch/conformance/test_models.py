"""The model-family matrix, against the cache under test (opt-in: ``--tqbatch-models``)."""

from __future__ import annotations

import pytest

from tqbatch.conformance import Found, judge, spec
from tqbatch.testing import plugin


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "model_cell" not in metafunc.fixturenames:
        return
    if plugin.harness(metafunc.config).models:
        from tqbatch.testing import families, matrix

        cells = [(f, s) for f in families.FAMILIES for s in matrix.SCENARIOS]
        metafunc.parametrize("model_cell", cells, ids=[f"{f}-{s}" for f, s in cells])
    else:
        off = pytest.mark.skip(reason="the model-family matrix is opt-in: --tqbatch-models")
        metafunc.parametrize("model_cell", [pytest.param(None, marks=off)], ids=["off"])


def test_model_family(model_cell, tqbatch_harness, request):
    """The cache passes, inside mlx-vlm's model code, wherever mlx-lm's BatchKVCache passes."""
    from tqbatch.testing import matrix

    state = tqbatch_harness
    family, scenario = model_cell
    if state.impl.__module__.startswith("tqbatch.cache"):
        target = matrix.target_for("tqbatch")
    else:
        target = matrix.Target(spec(state), state.impl)
    cell = matrix.run_cell(family, scenario, target)
    if cell.status in ("N/A", "NONDET"):
        pytest.skip(f"{cell.status}: {cell.detail}")
    if cell.status == "PASS":
        return
    baseline = matrix.run_cell(family, scenario, matrix.target_for(matrix.BASELINE))
    if baseline.status != "PASS":
        pytest.skip(
            f"{matrix.BASELINE} does not pass here either ({baseline.short()}): the limitation "
            f"is below the cache; {cell.short()}"
        )
    judge(request, state, [Found("", "contract", f"{family} / {scenario}: {cell.short()}")])
