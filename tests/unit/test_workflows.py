"""The CI workflows as GitHub will run them: valid, on current GitHub-hosted runners, their nox
commands select sessions, the test job runs the README's quick start, and each job installs the
services its tests use.

Each check is also shown failing on a broken copy, so that a green result
means something (the workflows once selected no nox session in any cell
while every check here would have been silent).
"""

from __future__ import annotations

import datetime
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import nox.project
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import check_workflows  # noqa: E402
from check_workflows import (  # noqa: E402
    RUNNER_IMAGES,
    load_runner_images,
    runner_problems,
    schema_problems,
    selection_problems,
)
from run_workflow import context_for, load_workflow, matrix_cells  # noqa: E402
from workflow_expressions import DEFAULT_STATUS, condition  # noqa: E402

CI = ROOT / ".github" / "workflows" / "ci.yml"
NIGHTLY = ROOT / ".github" / "workflows" / "nightly.yml"
EXAMPLE = ROOT / "examples" / "conformance-workflow.yml"
WORKFLOWS = [str(CI), str(NIGHTLY)]
# The day these tests hold the workflows to: the table's own check, so that a
# retirement GitHub announces later fails check_workflows (lint), not old commits' tests.
CHECKED = load_runner_images()["checked"]


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


# ------------------------------------------------------------------ runner labels


def test_every_workflow_and_the_example_run_on_current_github_hosted_runners():
    every = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.yml"))
    assert runner_problems([*every, str(EXAMPLE)], today=CHECKED) == []


def test_the_check_covers_the_example_workflow_by_default():
    assert "examples/conformance-workflow.yml" in check_workflows.WORKFLOWS
    assert ".github/workflows/ci.yml" in check_workflows.WORKFLOWS


def test_a_retired_label_in_a_matrix_fails_naming_file_job_and_label(tmp_path):
    broken = tmp_path / "ci.yml"
    broken.write_text(
        CI.read_text().replace("os: [macos-15, ubuntu-24.04]", "os: [macos-14, ubuntu-24.04]")
    )
    problems = runner_problems([str(broken)], today=CHECKED)
    # Once for the job, though three matrix cells (one per Python) name it.
    assert len(problems) == 1, problems
    (problem,) = problems
    assert problem.startswith(f"{broken} job tests (matrix os=macos-14): runs-on 'macos-14'")
    assert "retired by GitHub on 2026-11-02" in problem
    assert "https://github.com/actions/runner-images/issues/13518" in problem
    assert "macos-15" in problem  # what to use instead


def test_a_retired_label_of_a_plain_job_and_of_the_example_fails(tmp_path):
    ci = tmp_path / "ci.yml"
    ci.write_text(CI.read_text().replace("runs-on: macos-15", "runs-on: macos-14"))
    example = tmp_path / "conformance-workflow.yml"
    example.write_text(EXAMPLE.read_text().replace("runs-on: macos-15", "runs-on: macos-14"))
    problems = runner_problems([str(ci), str(example)], today=CHECKED)
    assert any(p.startswith(f"{ci} job latest-upstream: runs-on 'macos-14'") for p in problems)
    assert any(
        p.startswith(f"{example} job conformance-macos: runs-on 'macos-14'") for p in problems
    )


def test_an_unknown_label_fails_naming_file_job_and_label(tmp_path):
    broken = tmp_path / "nightly.yml"
    # A typo GitHub accepts: the job waits for a runner that never comes.
    broken.write_text(NIGHTLY.read_text().replace("runs-on: ubuntu-24.04", "runs-on: ubuntu-24.40"))
    (problem,) = runner_problems([str(broken)], today=CHECKED)
    assert problem.startswith(
        f"{broken} job database: runs-on 'ubuntu-24.40' is not a GitHub-hosted"
    )
    assert "self-hosted" in problem  # how to say it is one


def _workflow(tmp_path: Path, jobs: str) -> str:
    path = tmp_path / "wf.yml"
    path.write_text("on: push\njobs:\n" + textwrap.indent(textwrap.dedent(jobs), "  "))
    return str(path)


def test_matrix_include_values_and_label_lists_are_checked(tmp_path):
    workflow = _workflow(
        tmp_path,
        """
        a:
          runs-on: ${{ matrix.os }}
          strategy:
            matrix:
              os: [ubuntu-24.04]
              include:
                - os: ubuntu-20.04
          steps: [{run: "true"}]
        b:
          runs-on: [windows-2019]
          steps: [{run: "true"}]
        """,
    )
    problems = runner_problems([workflow], today=CHECKED)
    assert [p.split(": runs-on")[0] for p in problems] == [
        f"{workflow} job a (matrix os=ubuntu-20.04)",
        f"{workflow} job b",
    ]
    assert "retired by GitHub on 2025-04-15" in problems[0]
    assert "retired by GitHub on 2025-06-30" in problems[1]


def test_self_hosted_runners_and_runner_groups_are_exempt(tmp_path):
    workflow = _workflow(
        tmp_path,
        """
        mac:
          runs-on: [self-hosted, macOS, ARM64, macos-14]
          steps: [{run: "true"}]
        gpu:
          runs-on: ${{ matrix.runner }}
          strategy:
            matrix:
              runner: [[self-hosted, linux, gpu]]
          steps: [{run: "true"}]
        group:
          runs-on:
            group: our-large-runners
          steps: [{run: "true"}]
        """,
    )
    assert runner_problems([workflow], today=CHECKED) == []


def test_a_matrix_computed_at_run_time_cannot_be_checked_so_fails(tmp_path):
    workflow = _workflow(
        tmp_path,
        """
        a:
          runs-on: ${{ matrix.os }}
          strategy:
            matrix: ${{ fromJSON(vars.OSES) }}
          steps: [{run: "true"}]
        """,
    )
    (problem,) = runner_problems([workflow], today=CHECKED)
    assert problem.startswith(f"{workflow} job a: its matrix is computed at run time")


def test_a_label_fails_once_its_announced_retirement_day_has_come(tmp_path):
    table = load_runner_images()
    table["runners"]["macos-15"] = {**table["runners"]["macos-15"], "retirement": CHECKED}
    day_before = CHECKED - datetime.timedelta(days=1)
    assert runner_problems([str(NIGHTLY)], table, today=day_before) == []
    (problem,) = runner_problems([str(NIGHTLY)], table, today=CHECKED)
    assert "job fuzz (matrix os=macos-15): runs-on 'macos-15'" in problem


def test_the_runner_table_is_dated_and_every_entry_sourced():
    raw = tomllib.loads(RUNNER_IMAGES.read_text())
    assert isinstance(raw["checked"], datetime.date)
    assert RUNNER_IMAGES.read_text().startswith(
        f"# GitHub-hosted runner labels, last checked {raw['checked']}"
    )
    labels = [r["label"] for r in raw["runner"]]
    assert len(labels) == len(set(labels))
    for entry in raw["runner"]:
        assert entry["status"] in ("current", "retired"), entry
        assert entry["arch"] in ("x64", "arm64"), entry
        assert entry["source"].startswith("https://"), entry
        if entry["status"] == "retired":
            assert entry["retirement"] <= raw["checked"], entry
    retired = {r["label"] for r in raw["runner"] if r["status"] == "retired"}
    assert {"macos-14", "macos-13", "ubuntu-20.04"} <= retired
    current = {r["label"] for r in raw["runner"] if r["status"] == "current"}
    assert {"macos-15", "macos-26", "macos-latest", "ubuntu-24.04", "ubuntu-latest"} <= current


def test_check_workflows_exits_1_on_a_retired_label(tmp_path):
    broken = tmp_path / "ci.yml"
    broken.write_text(CI.read_text().replace("macos-15", "macos-14"))
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_workflows.py"), str(broken)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert f"{broken} job tests (matrix os=macos-14): runs-on 'macos-14'" in result.stdout


# ------------------------------------------------------------ what jobs install


def _steps_for(job: dict, os_name: str) -> list[str]:
    """The ``run:`` of each step a runner of ``os_name`` runs (``if:`` on ``runner.os`` applied)."""
    context = {**context_for({}, {}), "runner": {"os": os_name}}
    return [
        step["run"]
        for step in job["steps"]
        if "run" in step and condition(step.get("if"), context, DEFAULT_STATUS)
    ]


# Jobs that run the pytest suite, which needs redis-server under CI.
SUITE_JOBS = ["tests", "latest-upstream"]


@pytest.mark.parametrize("job_name", SUITE_JOBS)
def test_jobs_running_the_suite_install_redis_on_each_os(job_name):
    job = load_workflow(CI)["jobs"][job_name]
    linux, macos = _steps_for(job, "Linux"), _steps_for(job, "macOS")
    assert "sudo apt-get update && sudo apt-get install -y redis-server" in linux
    assert "brew install redis" not in linux
    assert "brew install redis" in macos
    assert not any("apt-get" in run for run in macos)
    # Installed before anything runs the suite.
    suite = next(i for i, run in enumerate(linux) if "pytest" in run or "nox -s" in run)
    assert linux.index("sudo apt-get update && sudo apt-get install -y redis-server") < suite


# Jobs that run only parts of the suite that start no Redis: the unit and
# property directories, and the plugin's tests (tqbatch.conformance).
PART_JOBS = ["simulated-mac"]
NO_REDIS_PARTS = re.compile(
    r"-m pytest (tests/unit tests/property|--pyargs tqbatch\.conformance)\b"
)


def test_only_the_suite_jobs_run_the_suite():
    # A new job that runs pytest must be added to SUITE_JOBS (and install Redis),
    # or to PART_JOBS if it runs only parts that need no Redis.
    running = {
        name
        for workflow in (CI, NIGHTLY)
        for name, job in load_workflow(workflow)["jobs"].items()
        for step in job.get("steps", [])
        if re.search(r"-m pytest|nox -s (tests|latest)\b", step.get("run", ""))
    }
    assert running == set(SUITE_JOBS) | set(PART_JOBS)


@pytest.mark.parametrize("job_name", PART_JOBS)
def test_jobs_running_parts_of_the_suite_run_no_part_that_needs_redis(job_name):
    job = load_workflow(CI)["jobs"][job_name]
    commands = [
        line
        for step in job["steps"]
        for line in step.get("run", "").replace("\\\n", " ").splitlines()
        if "-m pytest" in line
    ]
    assert commands
    assert all(NO_REDIS_PARTS.search(" ".join(line.split())) for line in commands), commands


def test_ci_run_installs_nothing_outside_the_workflow():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert not any(re.search(r"\b(apt-get|apt|brew|redis-server)\b", line) for line in commands)
