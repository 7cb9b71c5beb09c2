"""A model-level gap is a verdict only if an identical second run reproduces it.

``run_cell`` is driven by stand-ins for one run of a cell, so that what is
tested is the decision, not a model: a gap failure the backend reproduces
stays FAIL, one it does not becomes NONDET (no verdict, both gaps named),
and a failure of the cache oracle is never run again.
"""

from __future__ import annotations

import pytest

from tqbatch.workbench import model_matrix
from tqbatch.workbench.model_matrix import regressions

FAMILY, SCENARIO = "qwen3", "prefill_decode"


def _runs(monkeypatch, *cells):
    """Make each run of a cell return the next of ``cells``; returns the call count."""
    calls = []

    def once(family, scenario, target, diagnose=False):
        if diagnose:  # the diagnosis run after a reproduced gap: no attribution here
            return model_matrix.Cell(FAMILY, SCENARIO, target.name, "PASS")
        calls.append(1)
        return cells[len(calls) - 1]

    monkeypatch.setattr(model_matrix, "_run_cell_once", once)
    return calls


def _cell(status, gap, gap_failure=False, target="tqbatch"):
    return model_matrix.Cell(FAMILY, SCENARIO, target, status, "", gap, gap_failure=gap_failure)


TARGET = model_matrix.Target("tqbatch", None)


def test_a_reproduced_gap_is_a_failure(monkeypatch):
    calls = _runs(monkeypatch, _cell("FAIL", 2.5, True), _cell("FAIL", 2.5, True))
    cell = model_matrix.run_cell(FAMILY, SCENARIO, TARGET)
    assert (cell.status, len(calls)) == ("FAIL", 2)


@pytest.mark.parametrize("second", [_cell("PASS", 1e-5), _cell("FAIL", 1.1, True)])
def test_a_gap_the_backend_does_not_reproduce_is_no_verdict(monkeypatch, second):
    _runs(monkeypatch, _cell("FAIL", 2.5, True), second)
    cell = model_matrix.run_cell(FAMILY, SCENARIO, TARGET)
    assert cell.status == "NONDET"
    assert "2.5" in cell.detail and f"{second.gap:.3g}" in cell.detail
    baseline = _cell("PASS", 1e-5, target="BatchKVCache")
    assert regressions([cell, baseline], "tqbatch") == []  # not blamed on the cache


def test_an_oracle_failure_is_not_run_again(monkeypatch):
    calls = _runs(monkeypatch, _cell("FAIL", 2.5, gap_failure=False))
    assert model_matrix.run_cell(FAMILY, SCENARIO, TARGET).status == "FAIL"
    assert len(calls) == 1
