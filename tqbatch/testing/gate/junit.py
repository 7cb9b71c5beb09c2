"""A campaign's result as a JUnit XML report: ``tqbatch fuzz --junit-xml PATH``.

CI systems read JUnit XML to list what failed. One ``testsuite`` per
campaign; in it one ``testcase`` per distinct failure identity (check@op),
or one passing ``testcase`` named ``campaign`` when nothing failed:

- a failure of the contract is a ``failure`` (its message, and the scenario
  file that reproduces it); a failure of the harness itself an ``error``;
- a policy difference (``tqbatch.testing.contract.checks``: not the contract, and not
  a reason to exit 1) passes, with the difference in ``system-out``;
- a replay-only campaign that replayed nothing checked nothing: its
  ``campaign`` testcase is ``skipped``.

Counts (examples, examples replayed from the database, shrink runs, rounds)
and the run's options are ``properties`` of the suite; each failure's
testcase says in its own ``properties`` whether it was found while replaying
the example database, and where its scenario was saved. Written with
``xml.etree`` only.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

from tqbatch.testing.search.campaign import CampaignResult

__all__ = ["campaign_junit", "write_junit"]

SUITE = "tqbatch fuzz"


def campaign_junit(
    result: CampaignResult,
    *,
    target: str,
    paths: list | None = None,
    options: dict | None = None,
    nothing_checked: bool = False,
) -> ET.ElementTree:
    """The report of ``result`` against ``target`` (``impl_spec``).

    ``paths``: each failure's saved scenario (``save_failures``), or None.
    ``options``: the run's options, listed as suite properties.
    ``nothing_checked``: the campaign ran no example (a replay with nothing
    saved): its testcase is skipped.
    """
    paths = list(paths) if paths is not None else [None] * len(result.failures)
    classname = f"tqbatch.fuzz.{target}"
    suites = ET.Element("testsuites", name=SUITE)
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=f"{SUITE}: {target}",
        timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
        time=f"{result.seconds:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    counts = {
        "target": target,
        "examples": result.examples,
        "replayed": result.replayed,
        "shrink_runs": result.shrink_runs,
        "rounds": result.rounds,
        "exhausted": result.exhausted,
    }
    for key, value in {**counts, **{f"option.{k}": v for k, v in (options or {}).items()}}.items():
        ET.SubElement(props, "property", name=key, value=_text(value))

    tally = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for failure, path in zip(result.failures, paths):
        tally["tests"] += 1
        case = ET.SubElement(
            suite,
            "testcase",
            classname=classname,
            name=failure.identity or "(harness)",
            time="0",
        )
        case_props = ET.SubElement(case, "properties")
        for key, value in (
            ("level", failure.level),
            ("replayed", failure.replayed),
            ("ops", len(failure.ops or ())),
            ("scenario", path or ""),
        ):
            ET.SubElement(case_props, "property", name=key, value=_text(value))
        headline = failure.summary or "failed"
        body = failure.message
        if path:
            body += f"\n\nscenario: {path}\nreproduce: tqbatch replay {path}"
        if failure.level == "policy":
            ET.SubElement(case, "system-out").text = f"policy difference: {body}"
        elif not failure.identity:
            tally["errors"] += 1
            ET.SubElement(case, "error", message=headline, type="harness").text = body
        else:
            tally["failures"] += 1
            ET.SubElement(case, "failure", message=headline, type=failure.level).text = body
    if not result.failures:
        tally["tests"] += 1
        case = ET.SubElement(
            suite, "testcase", classname=classname, name="campaign", time=f"{result.seconds:.3f}"
        )
        if nothing_checked:
            tally["skipped"] += 1
            ET.SubElement(
                case,
                "skipped",
                message="nothing was checked: the database holds no saved example of this target",
            )
        else:
            ET.SubElement(case, "system-out").text = (
                f"{result.examples} examples generated, {result.replayed} replayed "
                "from the database: no failure"
            )
    for element in (suites, suite):
        for key, n in tally.items():
            element.set(key, str(n))
    suites.set("time", suite.get("time"))
    ET.indent(suites)
    return ET.ElementTree(suites)


def write_junit(result: CampaignResult, path, **kwargs) -> Path:
    """Write ``campaign_junit(result, **kwargs)`` to ``path`` (folders made); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    campaign_junit(result, **kwargs).write(path, encoding="utf-8", xml_declaration=True)
    return path


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)
