"""``tqbatch fuzz --junit-xml``: the report parses, and its counts are the campaign's."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.gate.junit import write_junit
from tqbatch.testing.search.campaign import CampaignResult

TARGET = "tqbatch.testing.mutants:SizeAsArray"


def _failure(identity, level, *, replayed=False, ops=2):
    return Failure(
        impl=TARGET,
        ops=[{"op": "new", "left_padding": [0]}] * ops,
        message=f"[{identity or 'harness'}] first line\nsecond line",
        identity=identity,
        check=identity.split("@")[0],
        level=level,
        what=f"what {identity} found",
        final=True,
        replayed=replayed,
    )


def _read(path):
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    return root, suite, props


def _counts(element):
    return {k: int(element.get(k)) for k in ("tests", "failures", "errors", "skipped")}


def test_one_testcase_per_distinct_failure(tmp_path):
    result = CampaignResult(examples=12, replayed=3, shrink_runs=40, rounds=2, seconds=1.5)
    result.failures = [
        _failure("size_type", "contract", replayed=True, ops=1),
        _failure("mask@filter", "policy"),
        _failure("", "harness", ops=0),
    ]
    paths = ["fuzz-failures/a.json", "fuzz-failures/b.json", None]
    path = write_junit(
        result,
        tmp_path / "reports" / "fuzz.xml",
        target=TARGET,
        paths=paths,
        options={"seed": 7, "database": "redis://127.0.0.1:6379/0", "replay_only": False},
    )
    root, suite, props = _read(path)
    want = {"tests": 3, "failures": 1, "errors": 1, "skipped": 0}
    assert _counts(root) == _counts(suite) == want
    assert props["target"] == TARGET
    assert (props["examples"], props["replayed"], props["shrink_runs"]) == ("12", "3", "40")
    assert props["option.seed"] == "7" and props["option.replay_only"] == "false"

    contract, policy, harness = suite.findall("testcase")
    assert [c.get("name") for c in (contract, policy, harness)] == [
        "size_type",
        "mask@filter",
        "(harness)",
    ]
    failure = contract.find("failure")
    assert failure.get("message") == "what size_type found"
    assert failure.get("type") == "contract"
    assert "second line" in failure.text and "fuzz-failures/a.json" in failure.text
    case_props = {p.get("name"): p.get("value") for p in contract.find("properties")}
    assert case_props == {
        "level": "contract",
        "replayed": "true",
        "ops": "1",
        "scenario": "fuzz-failures/a.json",
    }
    # A policy difference is listed but does not fail (the command exits 0 for it).
    assert policy.find("failure") is None and "policy difference" in policy.find("system-out").text
    assert harness.find("error").get("type") == "harness"


def test_a_clean_campaign_is_one_passing_testcase(tmp_path):
    result = CampaignResult(examples=20, replayed=2, seconds=3.0, rounds=4)
    root, suite, props = _read(write_junit(result, tmp_path / "clean.xml", target="tqbatch"))
    assert _counts(root) == {"tests": 1, "failures": 0, "errors": 0, "skipped": 0}
    (case,) = suite.findall("testcase")
    assert case.get("name") == "campaign" and list(case.iter("failure")) == []
    assert float(case.get("time")) == 3.0


def test_a_replay_of_nothing_is_skipped(tmp_path):
    result = CampaignResult(rounds=1)
    root, suite, _ = _read(
        write_junit(result, tmp_path / "none.xml", target="tqbatch", nothing_checked=True)
    )
    assert _counts(root) == {"tests": 1, "failures": 0, "errors": 0, "skipped": 1}
    assert "nothing was checked" in suite.find("testcase/skipped").get("message")
