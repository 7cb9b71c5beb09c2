"""The server oracle's explanations: when a request that differs from its alone run is the server's.

Built from made-up verdicts, so each rule is checked on its own: the tables
of real servers are tests/e2e/test_servers.py's.
"""

from __future__ import annotations

import pytest

from tqbatch.workbench import server_report
from tqbatch.workbench.http_oracle import SCENARIOS, Reply, ScenarioResult, Verdict
from tqbatch.workbench.server_log import BatchLog
from tqbatch.workbench.server_process import Launch

SCENARIO = SCENARIOS["prefix-cache"]
REQUEST = SCENARIO.requests[0]
TQ = ("tqbatch.BatchTurboQuantKVCache",)


def _verdict(batched, alone, *, cached=(16, 48), served=TQ):
    return Verdict(
        request=REQUEST,
        status="PASS" if batched == alone else "FAIL",
        prompt_tokens=62,
        first_difference=None if batched == alone else 0,
        logprob_gap=0.0,
        served_by=served,
        served_alone_by=served,
        batched=Reply(200, tokens=batched, prompt_tokens=62, cached_tokens=cached[0]),
        alone=Reply(200, tokens=alone, prompt_tokens=62, cached_tokens=cached[1]),
    )


def _result(cache, verdict):
    launch = Launch(server="mlx-vlm", cache=cache)
    return ScenarioResult(SCENARIO, launch, verdicts=[verdict], batch_log=BatchLog(joins=1))


def _why(results):
    return server_report.explanation(results, results[0], results[0].verdicts[0])


def test_a_restored_prefix_is_the_server_s_where_mlx_vlm_class_answers_the_same():
    ours = _result("tqbatch", _verdict(("a", "b"), ("a", "c")))
    reference = _result("mlx-vlm", _verdict(("a", "b"), ("a", "c"), served=("mlx_vlm.X",)))
    assert "prefix cache re-quantizes" in _why([ours, reference])
    assert server_report.unexplained([ours, reference]) == []


@pytest.mark.parametrize(
    "reference_tokens, cached",
    [
        (None, (16, 48)),  # no mlx-vlm class in the run: nothing to compare with
        ((("a", "b"), ("a", "b")), (16, 48)),  # mlx-vlm's class answers otherwise
        ((("a", "b"), ("a", "c")), (16, 16)),  # both runs restored as much
    ],
    ids=["no reference", "reference differs", "same restore"],
)
def test_otherwise_a_difference_stays_the_cache_s(reference_tokens, cached):
    results = [_result("tqbatch", _verdict(("a", "b"), ("a", "c"), cached=cached))]
    if reference_tokens is not None:
        results.append(_result("mlx-vlm", _verdict(*reference_tokens, cached=cached)))
    assert _why(results) == ""
    assert len(server_report.unexplained(results)) == 1


def test_mlx_vlm_class_is_not_its_own_reference():
    theirs = _result("mlx-vlm", _verdict(("a", "b"), ("a", "c")))
    assert _why([theirs]) == ""


def test_a_difference_the_baseline_shows_too_is_the_server_s():
    ours = _result("tqbatch", _verdict(("a", "b"), ("a", "c"), cached=(0, 0)))
    baseline = _result("BatchKVCache", _verdict(("x",), ("y",), cached=(0, 0)))
    assert "no quantization too" in _why([ours, baseline])
