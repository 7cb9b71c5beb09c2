"""A survey of the state machine, against the cache under test (see ``tqbatch.conformance``)."""

from __future__ import annotations

import time

import pytest

from tqbatch.testing.gate.session import BY_OP, conclude, failing, options, repro


class _Live:
    """Writes each failure of the survey to the terminal as soon as it is listed.

    The test reports when the survey ends; this shows in a CI log, as it
    happens, what it will report.
    """

    def __init__(self, config: pytest.Config):
        self.reporter = config.pluginmanager.get_plugin("terminalreporter")
        self.capture = config.pluginmanager.get_plugin("capturemanager")
        self.start = time.monotonic()
        self.shown: set = set()
        self.started = False

    def __call__(self, result) -> None:
        # By identity: the processes' failures come in process order, not in the order found.
        new = [f for f in result.failures if f.key not in self.shown]
        self.shown.update(f.key for f in new)
        if not new or self.reporter is None or self.capture is None:
            return
        seconds = time.monotonic() - self.start
        with self.capture.global_and_fixture_disabled():
            if not self.started:  # off the line of progress characters
                self.reporter.write("\n")
                self.started = True
            for f in new:
                self.reporter.write_line(
                    f"tqbatch survey: {f.identity or '(harness)'} [{f.level}] found, "
                    f"shrunk to {len(f.ops or ())} ops, {seconds:.0f} s in"
                )


def _importable_spec(impl: type) -> str | None:
    """``impl``'s ``module:Class``, where another process can import the class by it."""
    from tqbatch.testing.target import impl_spec, load_impl

    spec = impl_spec(impl)
    try:
        return spec if load_impl(spec) is impl else None
    except Exception:  # noqa: BLE001 - a class defined where no import reaches: run here
        return None


@pytest.mark.tqbatch_expects(BY_OP)
def test_state_machine(tqbatch_harness, request):
    """A survey of the state machine lists no failure that is not known."""
    from hypothesis import settings

    from tqbatch.testing.search.campaign import CampaignResult, run_campaign, save_failures
    from tqbatch.testing.search.shards import run_in_processes

    state = tqbatch_harness
    examples = state.examples or settings.get_profile(state.profile).max_examples
    live = _Live(request.config)
    # Listed identities are tolerated from the start: examples steer around
    # them, and a listed failure is never shrunk nor counted as a find.
    campaign = dict(profile=state.profile, survey=True, listed=sorted(state.listed))
    spec = _importable_spec(state.impl)
    if state.survey_processes > 1 and spec is not None:
        result = run_in_processes(
            spec,
            processes=state.survey_processes,
            examples=examples,
            seed=state.seed,
            campaign=campaign,
            quiet_rounds=state.quiet_rounds,
            on_update=live,
        )
    else:
        result = run_campaign(
            state.impl,
            examples=examples,
            seed=state.seed,
            on_example=live,
            quiet_rounds=state.quiet_rounds,
            **campaign,
        )
    live(result)
    request.node.user_properties.append(("tqbatch_examples", result.examples))
    found = [*result.failures, *result.listed_seen]
    new = failing(state, found)
    if new:
        saved = options(
            request, state, examples=examples, profile=state.profile, seed=state.seed, survey=True
        )
        paths = save_failures(CampaignResult(failures=new), state.failures_dir, options=saved)
        for failure, path in zip(new, paths):
            if path is not None:
                failure.repro = repro(state, path)
    conclude(request, state, found)
