"""Meta-tests of the judges (tqbatch.testing.oracles.judges): what passes, what fails, and how.

Every check of a cache's numbers, in the state machine and in the workbench's
request oracle, goes through these functions, so they are held to exact
cases here: a bound met exactly passes, one past it fails, a non-finite
output fails, and rounding admission judges again only where it took
something.
"""

from __future__ import annotations

import numpy as np
import pytest

from tqbatch.testing.oracles.judges import compare, judge, judge_tokens
from tqbatch.testing.oracles.tolerances import content_tolerance


def test_within_the_bound_passes_and_past_it_fails():
    want = np.zeros((2, 3, 4), np.float32)
    tol = np.full_like(want, 0.5)
    assert compare(want + 0.5, want, tol).passed  # the bound itself is inside
    past = want.copy()
    past[1, 2, 3] = 0.75
    judgement = compare(past, want, tol)
    assert not judgement.passed
    assert judgement.ratio == pytest.approx(1.5)
    assert judgement.worst_at == (1, 2, 3)
    assert judgement.bad(1) == [2]  # the token axis of an (H, T, D) row


def test_a_non_finite_output_fails_even_where_the_bound_is_infinite():
    want = np.zeros(3, np.float32)
    got = np.array([0.0, np.nan, 0.0], np.float32)
    assert not compare(got, want, np.full(3, np.inf)).passed
    assert not compare(np.array([0.0, np.inf, 0.0], np.float32), want, np.ones(3)).passed


def test_empty_operands_pass():
    empty = np.zeros((2, 0, 4), np.float32)
    judgement = compare(empty, empty, empty)
    assert judgement.passed and judgement.ratio == 0.0 and judgement.detail() is None


def test_the_failure_sentence_names_difference_bound_precision_ratio_and_place():
    judgement = compare(np.array([0.0, 3.0]), np.array([0.0, 1.0]), np.array([1.0, 1.0]))
    detail = judgement.detail()
    assert detail.startswith("by 2 (bound 1 at ")
    assert "precision; 2x the tolerance at (1,))" in detail


def test_admission_judges_again_only_where_the_reference_took_something():
    reference = {"want": np.array([0.0, 1.0])}
    got = np.array([0.0, 2.0])
    calls = []

    def operands():
        calls.append("operands")
        return got, reference["want"], np.full(2, 0.1)

    def refuses():
        calls.append("admit")
        return False

    assert not judge(operands, refuses).passed
    assert calls == ["operands", "admit"]  # refused: judged once

    def takes():
        reference["want"] = got.copy()
        return True

    calls.clear()
    assert judge(operands, takes).passed
    assert calls == ["operands", "operands"]

    calls.clear()
    assert judge(lambda: (got, got, np.full(2, 0.1)), refuses).passed
    assert calls == []  # passed at once: admission is not asked


def test_tokens_are_judged_within_the_content_tolerance_of_the_reference():
    rng = np.random.default_rng(0)
    want = rng.standard_normal((2, 5, 64)).astype(np.float32)
    tol = content_tolerance(want)
    assert judge_tokens(want + 0.9 * tol, lambda: want).passed
    moved = want.copy()
    moved[0, 3] += 2 * tol[0, 3]  # one token moved by twice its bound
    judgement = judge_tokens(moved, lambda: want)
    assert not judgement.passed and judgement.bad(1) == [3]
    # Admission receives the bound the tokens were judged with.
    seen = []
    judge_tokens(moved, lambda: want, lambda t: seen.append(t) or False)
    assert len(seen) == 1 and np.array_equal(seen[0], tol)
