"""The CI workflows as GitHub will run them: valid, their nox commands select sessions, and
the test job runs the README's quick start.

Each check is also shown failing on a broken copy, so that a green result
means something (the workflows once selected no nox session in any cell
while every check here would have been silent).
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import nox.project
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from check_workflows import schema_problems, selection_problems  # noqa: E402
from run_workflow import load_workflow, matrix_cells  # noqa: E402

CI = ROOT / ".github" / "workflows" / "ci.yml"
NIGHTLY = ROOT / ".github" / "workflows" / "nightly.yml"
WORKFLOWS = [str(CI), str(NIGHTLY)]


def test_the_workflows_validate_against_githubs_schema():
    assert schema_problems(WORKFLOWS) == []


def test_a_broken_workflow_fails_the_schema_check(tmp_path):
    broken = tmp_path / "ci.yml"
    # `runs_on` for `runs-on`: a typo GitHub rejects when the workflow is queued.
    broken.write_text(CI.read_text().replace("runs-on: ${{ matrix.os }}", "runs_on: x", 1))
    problems = schema_problems([str(broken)])
    assert problems and any("ci.yml" in p for p in problems)


def test_every_nox_command_selects_a_session_in_every_matrix_cell():
    assert selection_problems(WORKFLOWS, str(ROOT / "noxfile.py")) == []


def _copy_project(tmp_path: Path) -> Path:
    for name in ("noxfile.py", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path / "noxfile.py"


def test_sessions_that_declare_no_python_fail_the_selection_check(tmp_path):
    # The noxfile as it was: sessions without `python=`, so `--python 3.12` selects nothing.
    noxfile = _copy_project(tmp_path)
    text = noxfile.read_text()
    noxfile.write_text(text.replace("@nox.session(python=PYTHONS)", "@nox.session"))
    problems = selection_problems(WORKFLOWS, str(noxfile))
    assert any("nightly.yml job fuzz" in p and "selects no session" in p for p in problems)
    assert any("ci.yml job latest-upstream" in p for p in problems)


def test_a_python_the_noxfile_does_not_declare_fails_the_selection_check(tmp_path):
    broken = tmp_path / "nightly.yml"
    broken.write_text(NIGHTLY.read_text().replace("--python 3.12", "--python 3.9"))
    problems = selection_problems([str(broken)], str(ROOT / "noxfile.py"))
    # Once per distinct command: every shard cell runs the same one.
    assert len(problems) == 1 and "selects no session" in problems[0]


def test_matrix_pythons_are_the_ones_the_project_declares():
    declared = nox.project.python_versions(nox.project.load_toml(str(ROOT / "pyproject.toml")))
    tests_job = load_workflow(CI)["jobs"]["tests"]
    assert sorted({c["python"] for c in matrix_cells(tests_job)}) == declared


def _readme_quick_start() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", readme, re.DOTALL).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_the_test_job_runs_the_readmes_quick_start_word_for_word():
    install_and_fuzz, test_command = _readme_quick_start()
    runs = [
        step["run"].strip() for step in load_workflow(CI)["jobs"]["tests"]["steps"] if "run" in step
    ]
    # The first command is split around the device choice (a hosted macOS
    # runner's GPU may fail the known-answer check): its two halves, in order.
    install, fuzz = install_and_fuzz.rsplit(" && ", 1)
    assert install in runs and fuzz in runs
    assert runs.index(install) < runs.index(fuzz) < runs.index(test_command)


def test_ci_runs_the_linux_test_job_through_the_workflow_runner():
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"run_workflow\.py \.github/workflows/ci\.yml tests\b", script)
    assert "os=ubuntu-24.04" in script


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: Path(p).name)
def test_every_action_used_is_one_the_runner_does_here(workflow):
    # scripts/run_workflow.py does these four locally; a fifth would fail `.ci/run`
    # only if it sat in the Linux test job, so it is caught here for every job.
    known = {
        "actions/checkout",
        "actions/setup-python",
        "actions/upload-artifact",
        "actions/download-artifact",
    }
    used = {
        step["uses"].split("@")[0]
        for job in load_workflow(workflow)["jobs"].values()
        for step in job.get("steps", [])
        if "uses" in step
    }
    assert used <= known
