"""The model-family matrix: the cache under test inside nine mlx-vlm families' own code.

Each (family, scenario) cell runs with the cache under test (``--impl``) and
with mlx-lm's ``BatchKVCache``; the drop-in requirement is that the target
passes wherever ``BatchKVCache`` does. For tqbatch's own cache the matrix in
docs/model-families.md must also say what the run finds, for both columns.
"""

from __future__ import annotations

import re

import pytest

from tqbatch.testing.mutants import MUTANTS
from tqbatch.testing.oracles.reference import TurboReferences
from tqbatch.testing.selfcheck.doubles import RoundsFarOtherwise, RoundsOtherwise
from tqbatch.workbench import model_matrix, vlm_families
from tqbatch.workbench.model_matrix import BASELINE

from .conftest import doc_matrix

CELLS = [(f, s) for f in vlm_families.FAMILIES for s in model_matrix.SCENARIOS]


@pytest.fixture(scope="module")
def target(impl):
    if impl.__module__.startswith("tqbatch.cache"):
        return model_matrix.target_for("tqbatch")
    return model_matrix.Target(f"{impl.__module__}:{impl.__qualname__}", impl)


@pytest.mark.parametrize(("family", "scenario"), CELLS, ids=[f"{f}-{s}" for f, s in CELLS])
def test_cell_passes_where_batchkvcache_passes(family, scenario, target):
    baseline = model_matrix.run_cell(family, scenario, model_matrix.target_for(BASELINE))
    cell = model_matrix.run_cell(family, scenario, target)
    if baseline.status == "PASS":
        assert cell.status == "PASS", cell.short()
    if target.name == "tqbatch":
        readme = doc_matrix("models")[family, scenario]
        assert readme["tqbatch"] == cell.status, (readme, cell.short())
        assert readme[BASELINE] == baseline.status, (readme, baseline.short())


def test_readme_matrix_covers_every_cell():
    assert sorted(doc_matrix("models")) == sorted(CELLS)


# ------------------------------------------------------------ the matrix can fail
# Each purpose-built broken cache is caught in a cell, by the check that should
# catch it (content, extract, attention, or qwen3_5's re-merge).


@pytest.mark.parametrize(
    ("mutant", "family", "scenario", "pattern"),
    [
        ("ExtractDropsLastToken", "qwen2", "continuous", r"extract of A: keys"),
        ("ExtendAlignsOnCapacity", "qwen2", "continuous", r"extend: keys"),
        ("HandWrittenMaskHidesLeftPadded", "llama", "prefill_decode", r"attention output"),
        ("MergeDropsFullPrecisionMembers", "qwen3_5", "prefill_decode", r"prefill"),
        # At float32 the first commit's keys; at TF32, whose bound is wider, a
        # later commit's (the drift grows with every re-quantizing finalize).
        ("FinalizeRequantizes", "qwen2", "speculative", r"commit \[[\d, ]+\]: (keys|values)"),
    ],
)
def test_matrix_catches_a_broken_cache(mutant, family, scenario, pattern):
    cell = model_matrix.run_cell(family, scenario, model_matrix.Target(mutant, MUTANTS[mutant]))
    assert cell.status == "FAIL", cell.short()
    assert re.search(pattern, cell.detail), cell.detail


def test_an_idx_attribute_breaks_lfm2s_rollback():
    """Why tqbatch has no ``_idx``: lfm2's rollback takes any cache with one for a
    dense cache and refuses packed keys, even when every row accepts alike."""
    cell = model_matrix.run_cell(
        "lfm2", "uniform_rollback", model_matrix.Target("idx", MUTANTS["HasIdxAttribute"])
    )
    assert cell.status == "ERROR" and "NotImplementedError" in cell.detail, cell.short()


def test_matrix_catches_mlx_vlms_cache_attending_padding_in_qwen3_5():
    """mlx-vlm's own class takes qwen3_5's decode path without a mask: the
    attention check sees padding attended, which the content check cannot."""
    cell = model_matrix.run_cell("qwen3_5", "prefill_decode", model_matrix.target_for("mlx-vlm"))
    assert cell.status == "FAIL" and "attention output" in cell.detail, cell.short()


def test_the_model_level_check_fails_a_wrong_model_output():
    """Where mlx-vlm's own rotating window cache gets left-padded rows wrong in a
    verify block, BatchKVCache's logits leave the request run alone."""
    cell = model_matrix.run_cell("gpt_oss", "uniform_rollback", model_matrix.target_for(BASELINE))
    assert cell.status == "FAIL" and cell.gap > model_matrix.MODEL_GAP_LIMIT, cell.short()


def test_matrix_admits_a_cache_that_rounds_otherwise(monkeypatch):
    """A correct cache that picks other codes where rounding allows (as a GPU does)
    passes every cell tqbatch passes, up to the first cell where its nudge moved
    a code or norm (a few cells in: one coordinate in thousands moves), and
    that cell failed before the oracle admitted rounding choices."""
    target = model_matrix.Target("RoundsOtherwise", RoundsOtherwise)
    passing = [cell for cell in CELLS if doc_matrix("models")[cell]["tqbatch"] == "PASS"]
    for family, scenario in passing:
        cell = model_matrix.run_cell(family, scenario, target)
        assert cell.status == "PASS", (family, scenario, cell.short())
        if cell.admitted:
            break
    else:
        pytest.fail("the nudge moved no code or norm in any cell")
    monkeypatch.setattr(TurboReferences, "admit_rounding", lambda *a: None)
    cell = model_matrix.run_cell(family, scenario, target)
    assert cell.status == "FAIL" and "differ" in cell.detail, cell.short()


@pytest.mark.float32_only(reason="a 1e-3 nudge is within TF32's rounding band (3.9e-3)")
def test_matrix_fails_a_cache_past_the_rounding_band():
    cell = model_matrix.run_cell(
        "qwen2", "speculative", model_matrix.Target("RoundsFarOtherwise", RoundsFarOtherwise)
    )
    assert cell.status == "FAIL" and "differ" in cell.detail, cell.short()
