"""A campaign runs without Hypothesis's line-coverage tracing, and finds the same with it."""

from __future__ import annotations

import contextlib

from hypothesis.internal import observability

from tqbatch import BatchTurboQuantKVCache
from tqbatch.testing.mutants import MUTANTS
from tqbatch.testing.search import campaign, hypothesis_internals


def test_no_coverage_is_collected_while_a_campaign_runs_and_the_flag_is_restored():
    before = observability.OBSERVABILITY_COLLECT_COVERAGE
    seen = []
    campaign.run_campaign(
        BatchTurboQuantKVCache,
        examples=2,
        profile="ci",
        on_example=lambda result: seen.append(observability.OBSERVABILITY_COLLECT_COVERAGE),
    )
    assert seen and not any(seen)
    assert observability.OBSERVABILITY_COLLECT_COVERAGE is before


def test_tracing_does_not_change_what_a_campaign_draws_or_finds(monkeypatch):
    # Turned back on (as before the campaign turned it off), the same seeds
    # must draw the same ops and report the same shrunk failure.
    cases = [(BatchTurboQuantKVCache, False), (MUTANTS["SizeAsArray"], False)]
    for impl, survey in cases:
        off = campaign.run_campaign(impl, examples=4, profile="ci", survey=survey)
        with monkeypatch.context() as patched:
            patched.setattr(hypothesis_internals, "no_coverage_tracing", contextlib.nullcontext)
            on = campaign.run_campaign(impl, examples=4, profile="ci", survey=survey)
        assert on.outcome() == off.outcome(), impl.__name__
    assert off.failures  # the mutant's failure was found both ways
