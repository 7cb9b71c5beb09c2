"""The server oracle's explanations: when a request that differs from its alone run is the server's.

Built from made-up verdicts, so each rule is checked on its own: the tables
of real servers are tests/e2e/test_servers.py's.
"""

from __future__ import annotations

from tqbatch.workbench import server_report
from tqbatch.workbench.http_oracle import SCENARIOS, Reply, ScenarioResult, Verdict
from tqbatch.workbench.server_log import BatchLog
from tqbatch.workbench.server_process import Launch

SCENARIO = SCENARIOS["concurrent"]
REQUEST = SCENARIO.requests[0]
TQ = ("tqbatch.BatchTurboQuantKVCache",)


def _verdict(batched, alone, *, served=TQ, served_alone=TQ):
    return Verdict(
        request=REQUEST,
        status="PASS" if batched == alone else "FAIL",
        prompt_tokens=14,
        first_difference=None if batched == alone else 0,
        logprob_gap=0.0,
        served_by=served,
        served_alone_by=served_alone,
        batched=Reply(200, tokens=batched, prompt_tokens=14),
        alone=Reply(200, tokens=alone, prompt_tokens=14),
    )


def _result(cache, verdict):
    launch = Launch(server="mlx-vlm", cache=cache)
    return ScenarioResult(SCENARIO, launch, verdicts=[verdict], batch_log=BatchLog(joins=1))


def _why(results):
    return server_report.explanation(results, results[0], results[0].verdicts[0])


def test_a_difference_with_no_server_reason_is_the_cache_s():
    results = [_result("tqbatch", _verdict(("a", "b"), ("a", "c")))]
    assert _why(results) == ""
    assert len(server_report.unexplained(results)) == 1


def test_a_difference_the_baseline_shows_too_is_the_server_s():
    ours = _result("tqbatch", _verdict(("a", "b"), ("a", "c")))
    baseline = _result("BatchKVCache", _verdict(("x",), ("y",)))
    assert "no quantization too" in _why([ours, baseline])
    assert server_report.unexplained([ours, baseline]) == []
    passing = _result("BatchKVCache", _verdict(("x",), ("x",)))
    assert _why([ours, passing]) == ""


def test_quantized_batched_and_not_alone_is_the_server_s():
    dense = ("mlx_vlm.BatchKVCache",)
    ours = _result("tqbatch", _verdict(("a", "b"), ("a", "c"), served_alone=dense))
    assert _why([ours]).startswith("precision")
