"""examples/conformance-workflow.yml, the workflow a cache's owner copies: valid, and it runs the
README's pytest-plugin command."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from check_workflows import schema_problems  # noqa: E402
from run_workflow import load_workflow  # noqa: E402

WORKFLOW = ROOT / "examples" / "conformance-workflow.yml"


def _readme_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### In your own CI: the pytest plugin") :]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


def _words(text: str) -> list[str]:
    return text.replace(">-", " ").split()


def test_the_example_workflow_validates_against_githubs_schema():
    assert schema_problems([str(WORKFLOW)]) == []


def test_the_example_workflow_runs_the_readmes_plugin_command():
    steps = load_workflow(WORKFLOW)["jobs"]["conformance"]["steps"]
    runs = [_words(step["run"]) for step in steps if "run" in step]
    command = next(r for r in runs if "--pyargs" in r)
    assert command[:5] == ["python", "-m", "pytest", "--pyargs", "tqbatch.conformance"]
    snippet = _readme_snippet()
    start = snippet.index("python -m pytest --pyargs")
    assert _words(snippet[start : snippet.index("- if:", start)]) == command
    uploaded = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert "tqbatch-failures/" in uploaded["with"]["path"]
    assert "tqbatch-junit.xml" in uploaded["with"]["path"]


def test_the_macos_lane_runs_the_linux_jobs_steps_on_a_current_mac_after_a_device_choice():
    jobs = load_workflow(WORKFLOW)["jobs"]
    linux, macos = jobs["conformance"], jobs["conformance-macos"]
    assert macos["runs-on"] == "macos-15"
    assert "continue-on-error" not in macos  # a gate, like the Linux job
    choice = [s for s in macos["steps"] if s.get("name", "").startswith("choose the device")]
    (choice,) = choice
    # The device choice as ci.yml makes it (tests/e2e/test_simulated_device_choice.py
    # runs that one on simulated Macs), with the tqbatch the example installs.
    ci = load_workflow(Path(__file__).resolve().parents[2] / ".github/workflows/ci.yml")
    (ours,) = [s for s in ci["jobs"]["tests"]["steps"] if s.get("name") == choice["name"]]
    assert choice["run"] == ours["run"].replace(".venv/bin/tqbatch", "tqbatch")
    rest = [s for s in macos["steps"] if s is not choice]
    assert [s.get("run") for s in rest] == [s.get("run") for s in linux["steps"]]
    assert [s.get("uses") for s in rest] == [s.get("uses") for s in linux["steps"]]
    uploaded = next(s for s in rest if s.get("uses", "").startswith("actions/upload-artifact"))
    assert "backend-report/" in uploaded["with"]["path"]
    # Two jobs of one run cannot upload artifacts of the same name.
    names = [
        s["with"]["name"]
        for job in (linux, macos)
        for s in job["steps"]
        if s.get("uses", "").startswith("actions/upload-artifact")
    ]
    assert len(set(names)) == 2
