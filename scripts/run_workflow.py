"""Run one job of a GitHub Actions workflow here, step by step, as a Linux runner would.

    python scripts/run_workflow.py .github/workflows/ci.yml tests \\
        --matrix os=ubuntu-24.04 --matrix python=3.12

The steps run from the workflow file itself, so what this runs is what GitHub
runs: ``run:`` steps in ``bash --noprofile --norc -eo pipefail`` (GitHub's
default shell on Linux) with the workflow's, job's and step's ``env``,
``${{ }}`` expressions substituted, ``if:`` conditions evaluated (``success()``,
``failure()``, ``always()``), ``continue-on-error`` and the job's
``timeout-minutes`` honoured, and the files GitHub gives a step
(``GITHUB_ENV``, ``GITHUB_PATH``, ``GITHUB_OUTPUT``, ``GITHUB_STEP_SUMMARY``):
``GITHUB_ENV`` and ``GITHUB_PATH`` are read back between steps; outputs are
not (there is no ``steps`` context: the project's workflows use none). The
few actions the project's workflows use are done locally:

- ``actions/checkout``: the working tree is the checkout (run from a fresh clone);
- ``actions/setup-python``: a virtual environment of the ``python{version}`` found
  on ``PATH`` (nothing is downloaded; a missing interpreter fails the step), its
  ``bin`` first on ``PATH``;
- ``actions/upload-artifact`` / ``download-artifact``: a directory per artifact
  under ``--artifacts``.

Any other action fails the step, saying so. Exit status: 0 when the job
succeeded (or its ``if:`` skipped it), 1 when a step failed, 2 on a usage error
(unknown job, a matrix cell that does not exist, a job not for Linux).

The runner is Linux: ``runner.os`` is ``Linux`` (``RUNNER_OS`` too), so a step
under ``if: runner.os == 'macOS'`` is skipped and one under
``if: runner.os == 'Linux'`` runs. A job installs what its tests use itself
(``sudo apt-get install -y redis-server``), as on GitHub. Where this runs as
root (the build machines do, and may have no ``sudo``), a ``sudo`` shim comes
before the machine's directories on the steps' ``PATH``: it drops sudo's own
options (``-E``, ``-H``, ``-n``, ``-u root``, ...), runs the command, and
refuses to run as another user. Not root, the machine's own ``sudo`` is used.

What a job still takes from this machine instead of installing it (GitHub's
images have each too): ``bash``, coreutils and ``git`` (a clone is the
checkout; the runner's tests ``git init``); the Python interpreters
``setup-python`` would download, found on ``PATH`` or in pyenv's versions
instead (``--find-python`` says where); ``apt-get`` with a Debian or Ubuntu
package registry, and PyPI. Nothing else: ``nox``, the project and its test
tools are installed by the workflow's steps (``pip install``), Redis by its
install step.

Only PyYAML is needed beyond the standard library, so this runs before the
project is installed. ``nox_commands`` lists the ``nox`` invocations of a
workflow for each matrix cell (``tests/unit/test_workflows.py`` checks each
selects a session).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workflow_expressions import (  # noqa: E402
    DEFAULT_STATUS,
    condition,
    interpolate,
    to_string,
)

__all__ = [
    "find_python",
    "load_workflow",
    "matrix_cells",
    "nox_commands",
    "running_as_root",
    "write_sudo_shim",
]

# ---------------------------------------------------------------- workflows


def load_workflow(path) -> dict:
    """The workflow as a dict (PyYAML reads the ``on:`` key as True; renamed back)."""
    data = yaml.safe_load(Path(path).read_text())
    if True in data:
        data["on"] = data.pop(True)
    return data


def matrix_cells(job: dict) -> list[dict]:
    """Every combination of the job's ``strategy.matrix`` (include/exclude applied)."""
    matrix = dict((job.get("strategy") or {}).get("matrix") or {})
    include = matrix.pop("include", []) or []
    exclude = matrix.pop("exclude", []) or []
    keys = list(matrix)
    cells = [dict(zip(keys, combo)) for combo in itertools.product(*(matrix[k] for k in keys))]
    cells = [c for c in cells if not any(all(c.get(k) == v for k, v in x.items()) for x in exclude)]
    for extra in include:
        matching = [c for c in cells if all(c.get(k) == v for k, v in extra.items() if k in keys)]
        if matching and all(k in keys for k in extra):
            continue
        if matching:
            for c in matching:
                c.update(extra)
        else:
            cells.append(dict(extra))
    return cells or [{}]


def _cell(job: dict, wanted: dict[str, str]) -> dict:
    cells = matrix_cells(job)
    chosen = [c for c in cells if all(to_string(c.get(k)) == v for k, v in wanted.items())]
    if len(chosen) != 1:
        listing = "; ".join(json.dumps(c) for c in cells)
        raise ValueError(
            f"run_workflow: --matrix {wanted} picks {len(chosen)} of the job's cells "
            f"(it has: {listing})"
        )
    return chosen[0]


def context_for(
    workflow: dict,
    cell: dict,
    *,
    event: str = "push",
    inputs: dict | None = None,
    repository: str = "local/checkout",
    workspace: str = ".",
    temp: str = "/tmp",
) -> dict:
    """The expression contexts a job sees (``github``, ``matrix``, ``inputs``, ``runner``, ...)."""
    inputs = dict(inputs or {})
    dispatch = ((workflow.get("on") or {}) if isinstance(workflow.get("on"), dict) else {}).get(
        "workflow_dispatch"
    ) or {}
    for name, spec in (dispatch.get("inputs") or {}).items():
        if name not in inputs and event == "workflow_dispatch" and "default" in spec:
            inputs[name] = to_string(spec["default"])
    return {
        "github": {
            "event_name": event,
            "event": {"inputs": inputs} if event == "workflow_dispatch" else {},
            "repository": repository,
            "repository_owner": repository.split("/")[0],
            "run_id": str(int(time.time())),
            "run_number": "1",
            "ref": "refs/heads/main",
            "sha": _git_sha(),
            "workspace": workspace,
            "workflow": workflow.get("name", ""),
        },
        "matrix": cell,
        "inputs": inputs,
        "runner": {"os": "Linux", "arch": "X64", "temp": temp},
        "secrets": {},
        "env": {},
        "vars": {},
        "strategy": {"fail-fast": False},
    }


def _git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def nox_commands(workflow_path) -> list[dict]:
    """Every ``nox`` command line of the workflow, once per matrix cell, expanded.

    Each item: ``{"job", "cell", "argv"}``, ``argv`` the shell words from ``nox``
    on (``nox -s tests --python 3.12 -- ...``), up to the end of that command.
    """
    workflow = load_workflow(workflow_path)
    found = []
    for job_name, job in workflow["jobs"].items():
        for cell in matrix_cells(job):
            context = context_for(workflow, cell, event="workflow_dispatch")
            for step in job.get("steps", []):
                if "run" not in step:
                    continue
                script = interpolate(step["run"], context)
                for line in _logical_lines(script):
                    words = shlex.split(line, comments=True)
                    for command in _split_commands(words):
                        if command and Path(command[0]).name == "nox":
                            found.append({"job": job_name, "cell": cell, "argv": command})
    return found


def _logical_lines(script: str) -> list[str]:
    return [line for line in script.replace("\\\n", " ").splitlines() if line.strip()]


def _split_commands(words: list[str]) -> list[list[str]]:
    commands, current = [], []
    for word in words:
        if word in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [*commands, current]


# ------------------------------------------------------------------- running


class _Runner:
    def __init__(self, workflow: dict, job_name: str, cell: dict, args):
        self.workflow, self.job_name, self.cell, self.args = workflow, job_name, cell, args
        self.job = workflow["jobs"][job_name]
        self.workspace = str(Path.cwd())
        self.temp = tempfile.mkdtemp(prefix="runner-temp-")
        self.artifacts = Path(args.artifacts).resolve()
        self.context = context_for(
            workflow,
            cell,
            event=args.event,
            inputs=dict(args.input),
            repository=args.repository,
            workspace=self.workspace,
            temp=self.temp,
        )
        self.context["secrets"] = {
            "GITHUB_TOKEN": os.environ.get("GITHUB_TOKEN", ""),
        }
        self.env: dict[str, str] = {}  # what steps have added through GITHUB_ENV
        self.path: list[str] = []  # what steps have added through GITHUB_PATH
        self.shims = write_sudo_shim(Path(self.temp) / "shims") if running_as_root() else None
        self.summary = Path(self.temp) / "step_summary.md"
        self.summary.touch()
        self.failed = False

    # The variables a GitHub-hosted runner sets for every step.
    def base_env(self) -> dict[str, str]:
        github = self.context["github"]
        return {
            "CI": "true",
            "GITHUB_ACTIONS": "true",
            "GITHUB_WORKFLOW": to_string(github["workflow"]),
            "GITHUB_JOB": self.job_name,
            "GITHUB_EVENT_NAME": github["event_name"],
            "GITHUB_REPOSITORY": github["repository"],
            "GITHUB_REPOSITORY_OWNER": github["repository_owner"],
            "GITHUB_RUN_ID": github["run_id"],
            "GITHUB_RUN_NUMBER": github["run_number"],
            "GITHUB_REF": github["ref"],
            "GITHUB_SHA": github["sha"],
            "GITHUB_WORKSPACE": self.workspace,
            "RUNNER_OS": "Linux",
            "RUNNER_ARCH": "X64",
            "RUNNER_TEMP": self.temp,
            "GITHUB_STEP_SUMMARY": str(self.summary),
        }

    def run(self) -> int:
        runs_on = interpolate(self.job.get("runs-on", ""), self.context)
        labels = runs_on if isinstance(runs_on, list) else [runs_on]
        if not any(str(label).startswith(("ubuntu", "linux")) for label in labels):
            print(
                f"run_workflow: job {self.job_name} runs on {runs_on}, not Linux", file=sys.stderr
            )
            return 2
        status = dict(DEFAULT_STATUS)
        if not condition(self.job.get("if"), self.context, status):
            print(f"== job {self.job_name}: skipped (if: {self.job['if']})")
            return 0
        workflow_env = interpolate(self.workflow.get("env") or {}, self.context)
        self.context["env"] = {k: to_string(v) for k, v in workflow_env.items()}
        job_env = interpolate(self.job.get("env") or {}, self.context)
        self.context["env"].update({k: to_string(v) for k, v in job_env.items()})
        deadline = time.monotonic() + float(self.job.get("timeout-minutes", 360)) * 60
        results = []
        for number, step in enumerate(self.job.get("steps", []), 1):
            name = (
                interpolate(step.get("name"), self.context)
                or step.get("uses")
                or (step.get("run", "").strip().splitlines()[0])
            )
            status = {**DEFAULT_STATUS, "success": not self.failed, "failure": self.failed}
            if not condition(step.get("if"), self.context, status):
                results.append((name, "skipped", 0.0))
                continue
            print(f"\n== step {number}: {name}", flush=True)
            start = time.monotonic()
            ok = self.step(step, deadline)
            seconds = time.monotonic() - start
            outcome = "success" if ok else "failure"
            if not ok and step.get("continue-on-error"):
                outcome = "failure (continue-on-error)"
            elif not ok:
                self.failed = True
            results.append((name, outcome, seconds))
            print(f"== step {number}: {outcome} in {seconds:.0f} s", flush=True)
        print(f"\n== job {self.job_name} {json.dumps(self.cell)}:")
        for name, outcome, seconds in results:
            print(f"  {outcome:>8}  {seconds:6.0f} s  {name}")
        if self.summary.stat().st_size:
            print(f"== step summaries: {self.summary}")
        return 1 if self.failed else 0

    def step_env(self, step: dict) -> dict[str, str]:
        step_env = interpolate(step.get("env") or {}, self.context)
        env = {**os.environ, **self.base_env(), **self.context["env"], **self.env}
        env.update({k: to_string(v) for k, v in step_env.items()})
        # The sudo shim before the machine's PATH (whose sudo, if any, is not needed
        # by root), after what steps added, as GitHub's runner puts those first.
        shims = [str(self.shims)] if self.shims else []
        env["PATH"] = os.pathsep.join([*reversed(self.path), *shims, env.get("PATH", "")])
        return env

    def step(self, step: dict, deadline: float) -> bool:
        if "uses" in step:
            return self.action(step)
        shell = step.get("shell", "bash")
        script = interpolate(step["run"], self.context)
        files = {
            name: Path(tempfile.mkstemp(prefix=name.lower() + "-", dir=self.temp)[1])
            for name in ("GITHUB_ENV", "GITHUB_PATH", "GITHUB_OUTPUT")
        }
        script_file = Path(self.temp) / "step.sh"
        script_file.write_text(script)
        commands = {
            "bash": ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script_file)],
            "sh": ["sh", "-e", str(script_file)],
            "python": ["python", str(script_file)],
        }
        if shell not in commands:
            print(f"run_workflow: shell {shell!r} is not supported here", file=sys.stderr)
            return False
        env = self.step_env(step)
        env.update({name: str(path) for name, path in files.items()})
        cwd = Path(self.workspace, interpolate(step.get("working-directory", "."), self.context))
        left = deadline - time.monotonic()
        try:
            code = subprocess.run(
                commands[shell], env=env, cwd=cwd, timeout=max(left, 1)
            ).returncode
        except subprocess.TimeoutExpired:
            print("run_workflow: the job's timeout-minutes ran out", file=sys.stderr)
            return False
        self.env.update(_read_env_file(files["GITHUB_ENV"]))
        self.path += [p for p in files["GITHUB_PATH"].read_text().splitlines() if p.strip()]
        if code != 0:
            print(f"Error: Process completed with exit code {code}.", file=sys.stderr)
        return code == 0

    def action(self, step: dict) -> bool:
        uses = step["uses"].split("@")[0]
        with_ = {
            k: to_string(v) for k, v in interpolate(step.get("with") or {}, self.context).items()
        }
        if uses == "actions/checkout":
            if not Path(self.workspace, ".git").exists():
                print("run_workflow: checkout: run this from a git clone", file=sys.stderr)
                return False
            print("checkout: the working tree is the checkout")
            return True
        if uses == "actions/setup-python":
            return self.setup_python(with_.get("python-version", ""))
        if uses == "actions/upload-artifact":
            return self.upload(with_)
        if uses == "actions/download-artifact":
            return self.download(with_)
        print(f"run_workflow: action {step['uses']} is not supported here", file=sys.stderr)
        return False

    def setup_python(self, version: str) -> bool:
        found = find_python(version)
        if not found:
            print(f"setup-python: no working python{version} here (nothing is downloaded)")
            return False
        # A fresh environment of that interpreter, as a hosted runner's tool cache
        # is: what the job installs does not land in the machine's interpreter.
        home = Path(self.temp) / f"python-{version}"
        subprocess.run([found, "-m", "venv", str(home)], check=True)
        subprocess.run([home / "bin" / "python", "--version"], check=True)
        self.path.append(str(home / "bin"))
        self.env["pythonLocation"] = str(home)
        return True

    def upload(self, with_: dict) -> bool:
        name = with_.get("name") or "artifact"
        paths = [p for p in with_.get("path", "").splitlines() if p.strip()]
        target = self.artifacts / name
        copied = 0
        for pattern in paths:
            for source in Path(self.workspace).glob(pattern.strip()):
                destination = target / source.name
                destination.parent.mkdir(parents=True, exist_ok=True)
                if source.is_dir():
                    shutil.copytree(source, destination, dirs_exist_ok=True)
                else:
                    shutil.copy2(source, destination)
                copied += 1
        if not copied:
            mode = with_.get("if-no-files-found", "warn")
            print(f"upload-artifact {name}: no files found at {paths} ({mode})")
            return mode != "error"
        print(f"upload-artifact {name}: {copied} path(s) to {target}")
        return True

    def download(self, with_: dict) -> bool:
        pattern = with_.get("pattern") or with_.get("name") or "*"
        destination = Path(self.workspace, with_.get("path") or ".")
        merge = with_.get("merge-multiple") == "true"
        for source in sorted(self.artifacts.glob(pattern)) if self.artifacts.exists() else []:
            target = destination if merge else destination / source.name
            shutil.copytree(source, target, dirs_exist_ok=True)
            print(f"download-artifact: {source.name} to {target}")
        return True


# sudo for steps run as root: GitHub's hosted runners run steps as a user with
# passwordless sudo, so workflows write `sudo apt-get ...`; this machine runs them
# as root, where sudo may not be installed and would change nothing but the
# environment. Options that take a value are dropped with it.
SUDO_SHIM = """#!/bin/sh
# sudo, as scripts/run_workflow.py gives steps it runs as root: drops sudo's own
# options and runs the command (VAR=value words first set the environment).
while [ "$#" -gt 0 ]; do
    case "$1" in
        --) shift; break ;;
        -u|--user)
            if [ "$2" != root ] && [ "$2" != "#0" ]; then
                echo "sudo (run_workflow shim): cannot run as user $2 here" >&2
                exit 1
            fi
            shift 2 ;;
        -g|--group|-U|--other-user|-C|--close-from|-D|--chdir) shift 2 ;;
        -p|--prompt|-r|--role|-t|--type|-T|--command-timeout) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
if [ "$#" -eq 0 ]; then
    echo "usage: sudo [options] command (run_workflow shim)" >&2
    exit 1
fi
exec env "$@"
"""


def running_as_root() -> bool:
    """Whether steps run as root here (where they get the ``sudo`` shim)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def write_sudo_shim(directory: Path) -> Path:
    """``directory`` holding an executable ``sudo`` (``SUDO_SHIM``), for the steps' PATH."""
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "sudo"
    shim.write_text(SUDO_SHIM)
    shim.chmod(0o755)
    return directory


def find_python(version: str) -> str | None:
    """A working ``python{version}``: on ``PATH``, else in pyenv's versions (a tool cache).

    A candidate counts only if it runs and reports that version (a pyenv shim
    on ``PATH`` exists for versions that are installed but not active).
    """
    candidates = [shutil.which(f"python{version}")]
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += sorted(root.glob(f"{version}.*/bin/python{version}"), reverse=True)
    for candidate in filter(None, candidates):
        try:
            out = subprocess.run(
                [str(candidate), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return str(candidate)
    return None


def _read_env_file(path: Path) -> dict[str, str]:
    # GitHub's format: NAME=value lines, or NAME<<DELIMITER ... DELIMITER blocks.
    values, lines = {}, path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delimiter = line.split("<<", 1)
            block = []
            i += 1
            while i < len(lines) and lines[i] != delimiter:
                block.append(lines[i])
                i += 1
            values[name] = "\n".join(block)
        elif "=" in line:
            name, value = line.split("=", 1)
            values[name] = value
        i += 1
    return values


def _pair(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    key, value = text.split("=", 1)
    return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workflow", help="the workflow file, e.g. .github/workflows/ci.yml")
    parser.add_argument("job", help="the job's id in the file")
    parser.add_argument("--matrix", type=_pair, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--event", default="push", help="github.event_name (default: push)")
    parser.add_argument("--input", type=_pair, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--repository", default="local/checkout", help="github.repository (OWNER/NAME)"
    )
    parser.add_argument(
        "--artifacts", default="workflow-artifacts", help="where uploaded artifacts go"
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--find-python"]:  # for scripts: where setup-python would find a version
        found = find_python(argv[1])
        print(found or f"no working python{argv[1]}", file=sys.stdout if found else sys.stderr)
        return 0 if found else 1
    args = parser.parse_args(argv)
    workflow = load_workflow(args.workflow)
    if args.job not in workflow.get("jobs", {}):
        print(f"run_workflow: no job {args.job!r} in {args.workflow}", file=sys.stderr)
        return 2
    try:
        cell = _cell(workflow["jobs"][args.job], dict(args.matrix))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"== {args.workflow} job {args.job} {json.dumps(cell)} (event {args.event})")
    return _Runner(workflow, args.job, cell, args).run()


if __name__ == "__main__":
    sys.exit(main())
