"""scripts/run_workflow.py runs a workflow job's steps as a GitHub Linux runner would.

``.ci/run`` trusts it to run ``ci.yml``'s test job as written, so what it
must get right is tested here on small workflows: expressions, ``if:`` and
status functions, ``GITHUB_ENV``/``GITHUB_PATH`` between steps, matrix cells,
``setup-python``, artifacts, its exit status, ``runner.os`` (Linux) and the
``sudo`` shim through which a job's own install steps run as root.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import run_workflow  # noqa: E402
from workflow_expressions import (  # noqa: E402
    ExpressionError,
    condition,
    evaluate,
    interpolate,
)

CONTEXT = {
    "github": {"event_name": "push", "event": {"inputs": {}}, "repository": "o/r"},
    "matrix": {"os": "ubuntu-24.04", "python": "3.12", "shard": 0},
    "inputs": {"minutes": "5"},
}
RUNNING = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.mark.parametrize(
    "expression, value",
    [
        ("github.event.inputs.minutes || '40'", "40"),  # a missing input is null: falsy
        ("inputs.minutes || '40'", "5"),
        ("matrix.os == 'UBUNTU-24.04'", True),  # string comparison ignores case
        ("matrix['python']", "3.12"),
        ("matrix.shard == 0 && 'first' || 'other'", "first"),
        ("matrix.shard == '0'", True),  # a number and a string compare as numbers
        ("!(github.event_name == 'pull_request')", True),
        ("format('{0}-shard-{1}', matrix.os, matrix.shard)", "ubuntu-24.04-shard-0"),
        ("contains(fromJSON('[\"a\", \"b\"]'), 'B')", True),
        ("startsWith(matrix.os, 'ubuntu')", True),
        ("github.nothing.here", None),
        ("'it''s'", "it's"),
    ],
)
def test_expressions(expression, value):
    assert evaluate(expression, CONTEXT) == value


@pytest.mark.parametrize("bad", ["matrix.os ==", "(matrix.os", "nosuch()", "matrix.os $ 1"])
def test_expression_errors_are_typed(bad):
    with pytest.raises(ExpressionError):
        evaluate(bad, CONTEXT)


def test_interpolation_keeps_a_whole_expressions_type():
    assert interpolate("${{ matrix.shard }}", CONTEXT) == 0
    assert interpolate("py${{ matrix.python }}-${{ matrix.shard }}", CONTEXT) == "py3.12-0"
    # Two expressions back to back are two values, joined (the nightly's FUZZ_SEED).
    assert interpolate("${{ matrix.python }}${{ matrix.shard }}", CONTEXT) == "3.120"
    assert interpolate({"a": ["${{ matrix.os }}"]}, CONTEXT) == {"a": ["ubuntu-24.04"]}


def test_conditions_and_status_functions():
    ok = {"success": True, "failure": False, "always": True, "cancelled": False}
    failed = {"success": False, "failure": True, "always": True, "cancelled": False}
    assert condition(None, CONTEXT, ok) and not condition(None, CONTEXT, failed)
    # Without a status function a condition is `success() && (...)`.
    assert not condition("github.event_name == 'push'", CONTEXT, failed)
    assert condition("${{ github.event_name == 'push' }}", CONTEXT, ok)
    assert condition("failure()", CONTEXT, failed) and not condition("failure()", CONTEXT, ok)
    assert condition("always()", CONTEXT, failed)


def test_matrix_cells_with_include_and_exclude():
    job = {
        "strategy": {
            "matrix": {
                "os": ["a", "b"],
                "py": ["1", "2"],
                "exclude": [{"os": "b", "py": "1"}],
                "include": [{"os": "a", "py": "1", "extra": "x"}, {"os": "c", "py": "9"}],
            }
        }
    }
    cells = run_workflow.matrix_cells(job)
    assert {"os": "a", "py": "1", "extra": "x"} in cells
    assert {"os": "b", "py": "1"} not in cells
    assert {"os": "c", "py": "9"} in cells
    assert len(cells) == 4


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """An empty git clone to run workflows in (the runner's checkout is the working tree)."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(checkout: Path, workflow: str, *argv: str) -> int:
    path = checkout / "wf.yml"
    path.write_text(textwrap.dedent(workflow))
    return run_workflow.main([str(path), "job", "--artifacts", str(checkout / "art"), *argv])


def test_steps_see_github_env_path_matrix_and_status(checkout):
    code = _run(
        checkout,
        f"""
        on: push
        env:
          FROM_WORKFLOW: w
        jobs:
          job:
            runs-on: ${{{{ matrix.os }}}}
            strategy:
              matrix:
                os: [ubuntu-24.04, macos-15]
                python: ["{RUNNING}"]
            env:
              FROM_JOB: j
            steps:
              - uses: actions/checkout@v4
              - uses: actions/setup-python@v5
                with:
                  python-version: ${{{{ matrix.python }}}}
              - run: |
                  python -c 'import sys; print(sys.prefix)' > prefix.txt
                  echo "CHOSEN=${{{{ matrix.os }}}}" >> "$GITHUB_ENV"
                  printf 'MULTI<<EOF\\nline one\\nline two\\nEOF\\n' >> "$GITHUB_ENV"
                  mkdir -p tools && printf '#!/bin/sh\\necho tool ran\\n' > tools/mytool
                  chmod +x tools/mytool && echo "$PWD/tools" >> "$GITHUB_PATH"
              - name: later steps see them
                env:
                  FROM_STEP: s
                run: |
                  test "$CHOSEN" = ubuntu-24.04
                  test "$MULTI" = "$(printf 'line one\\nline two')"
                  test "$(mytool)" = "tool ran"
                  test "$FROM_WORKFLOW$FROM_JOB$FROM_STEP" = wjs
                  test "$CI" = true && test -n "$GITHUB_STEP_SUMMARY"
                  echo ok > reached.txt
              - if: github.event_name == 'pull_request'
                run: echo no > not-on-push.txt
              - run: exit 3
              - if: success()
                run: echo no > after-failure.txt
              - if: failure()
                run: echo yes > on-failure.txt
              - uses: actions/upload-artifact@v4
                if: always()
                with:
                  name: out-${{{{ matrix.os }}}}
                  path: reached.txt
        """,
        "--matrix",
        "os=ubuntu-24.04",
    )
    assert code == 1  # the `exit 3` step failed the job
    # setup-python's environment came first on PATH, and is of the asked version.
    assert "runner-temp-" in (checkout / "prefix.txt").read_text()
    assert (checkout / "reached.txt").read_text() == "ok\n"
    assert (checkout / "on-failure.txt").exists()
    assert not (checkout / "after-failure.txt").exists()
    assert not (checkout / "not-on-push.txt").exists()
    assert (checkout / "art" / "out-ubuntu-24.04" / "reached.txt").exists()


def test_a_clean_job_exits_0_and_continue_on_error_does_not_fail_it(checkout):
    workflow = """
        on: workflow_dispatch
        jobs:
          job:
            runs-on: ubuntu-latest
            steps:
              - run: exit 1
                continue-on-error: true
              - run: test "${{ github.event.inputs.minutes || '40' }}" = 7
        """
    path = checkout / "wf.yml"
    path.write_text(textwrap.dedent(workflow))
    args = ["--event", "workflow_dispatch", "--input", "minutes=7"]
    assert run_workflow.main([str(path), "job", *args]) == 0
    assert run_workflow.main([str(path), "job", "--event", "workflow_dispatch"]) == 1


def test_usage_errors(checkout):
    workflow = """
        on: push
        jobs:
          job:
            runs-on: ${{ matrix.os }}
            strategy:
              matrix:
                os: [ubuntu-24.04, macos-15]
            steps:
              - run: "true"
        """
    assert _run(checkout, workflow, "--matrix", "os=windows") == 2  # no such cell
    assert _run(checkout, workflow) == 2  # two cells match: which one?
    assert _run(checkout, workflow, "--matrix", "os=macos-15") == 2  # not a Linux runner
    assert run_workflow.main([str(checkout / "wf.yml"), "nosuchjob"]) == 2


def test_a_missing_interpreter_fails_setup_python(checkout):
    workflow = """
        on: push
        jobs:
          job:
            runs-on: ubuntu-24.04
            steps:
              - uses: actions/setup-python@v5
                with:
                  python-version: "2.1"
              - run: echo no > reached.txt
        """
    assert _run(checkout, workflow) == 1
    assert not (checkout / "reached.txt").exists()


def test_an_unknown_action_fails_its_step(checkout):
    workflow = """
        on: push
        jobs:
          job:
            runs-on: ubuntu-24.04
            steps:
              - uses: someone/something@v1
        """
    assert _run(checkout, workflow) == 1


def test_a_skipped_job(checkout):
    workflow = """
        on: push
        jobs:
          job:
            if: github.event_name == 'schedule'
            runs-on: ubuntu-24.04
            steps:
              - run: echo no > reached.txt
        """
    assert _run(checkout, workflow) == 0
    assert not (checkout / "reached.txt").exists()


def test_steps_for_another_os_are_skipped_and_linux_ones_run(checkout):
    workflow = """
        on: push
        jobs:
          job:
            runs-on: ubuntu-24.04
            steps:
              - if: runner.os == 'macOS'
                run: echo no > macos.txt
              - if: runner.os == 'Linux'
                run: echo "$RUNNER_OS" > linux.txt
              - if: ${{ runner.os != 'Windows' && !cancelled() }}
                run: echo yes > not-windows.txt
        """
    assert _run(checkout, workflow) == 0
    assert not (checkout / "macos.txt").exists()
    assert (checkout / "linux.txt").read_text() == "Linux\n"
    assert (checkout / "not-windows.txt").exists()


@pytest.fixture
def as_root(monkeypatch):
    """Steps run as they do on the build machines: as root, so with the sudo shim."""
    monkeypatch.setattr(run_workflow, "running_as_root", lambda: True)


def test_a_step_runs_sudo_through_the_shim_as_root(checkout, as_root):
    workflow = """
        on: push
        jobs:
          job:
            runs-on: ubuntu-24.04
            env:
              FROM_JOB: j
            steps:
              - run: |
                  command -v sudo > which-sudo.txt
                  sudo -E -H -n -u root WORDS="a b" sh -c 'echo "$WORDS $FROM_JOB" > sudo.txt'
                  sudo --preserve-env=FROM_JOB -- sh -c 'echo "$FROM_JOB" > dashdash.txt'
        """
    assert _run(checkout, workflow) == 0
    # The runner's own sudo, in its temporary directory, whatever this machine has.
    assert "runner-temp-" in (checkout / "which-sudo.txt").read_text()
    assert (checkout / "sudo.txt").read_text() == "a b j\n"
    assert (checkout / "dashdash.txt").read_text() == "j\n"


def test_the_shim_refuses_another_user_and_passes_exit_codes(tmp_path):
    shim = run_workflow.write_sudo_shim(tmp_path) / "sudo"
    other = subprocess.run([shim, "-u", "nobody", "true"], capture_output=True, text=True)
    assert other.returncode == 1 and "cannot run as user nobody" in other.stderr
    assert subprocess.run([shim, "sh", "-c", "exit 7"]).returncode == 7
    assert subprocess.run([shim, "-E"], capture_output=True).returncode == 1  # no command


def test_no_shim_when_not_root(checkout, monkeypatch):
    monkeypatch.setattr(run_workflow, "running_as_root", lambda: False)
    # Under .ci/run this suite itself runs in a runner step, whose PATH has the
    # outer runner's shim: this runner's steps must not get one of their own.
    outer = [d for d in os.environ.get("PATH", "").split(os.pathsep) if "runner-temp-" not in d]
    monkeypatch.setenv("PATH", os.pathsep.join(outer))
    workflow = """
        on: push
        jobs:
          job:
            runs-on: ubuntu-24.04
            steps:
              - run: (command -v sudo || echo none) > which-sudo.txt
        """
    assert _run(checkout, workflow) == 0
    assert "runner-temp-" not in (checkout / "which-sudo.txt").read_text()
