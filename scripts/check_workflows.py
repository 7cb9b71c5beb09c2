"""Check the GitHub workflows before GitHub runs them: schema, runner labels, nox selection.

    python scripts/check_workflows.py [WORKFLOW...] [--noxfile noxfile.py]

Three checks, each of which has failed a workflow that looked fine:

1. **Schema**: every workflow validates against GitHub's workflow schema
   (check-jsonschema's vendored copy, offline): unknown keys, wrong types,
   a bad ``on:`` trigger.
2. **nox selection**: every ``nox`` command in a workflow, expanded for each
   cell of its job's matrix, selects at least one session, and each selected
   session runs on the Python the command names. (``nox -s tests --python
   3.12`` against sessions that declare no Python selects nothing and fails,
   and did, on every cell.) The selection is nox's own: ``nox --list --json``.
3. **Runner labels**: every GitHub-hosted label a job's ``runs-on`` names, for
   each cell of its matrix (``runs-on: ${{ matrix.os }}`` is expanded), is
   one ``scripts/runner_images.toml`` lists as current. A retired label (GitHub
   retired ``macos-14`` on 2026-11-02 and fails the jobs that still name it)
   or an unknown one (a typo, whose job waits for a runner that never comes,
   or an image the table does not list yet) is refused, naming the file, the
   job and the label. A ``runs-on`` that lists ``self-hosted``, or names a
   runner ``group``, is not GitHub's to retire and is not checked.

Without arguments it checks ``.github/workflows/*.yml`` and
``examples/conformance-workflow.yml``. Exit 0 when all pass, 1 listing every
problem otherwise. ``nox -s lint`` runs this; ``tests/unit/test_workflows.py``
runs it on the real files and on broken copies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_workflow import context_for, load_workflow, matrix_cells, nox_commands  # noqa: E402
from workflow_expressions import ExpressionError, interpolate  # noqa: E402

# The workflows GitHub runs, and the one the README tells a cache's owner to copy.
WORKFLOWS = [
    *sorted(str(p) for p in Path(".github/workflows").glob("*.yml")),
    "examples/conformance-workflow.yml",
]
RUNNER_IMAGES = Path(__file__).resolve().parent / "runner_images.toml"
# Past this age the table is probably missing an announcement: said, not failed.
STALE_AFTER_DAYS = 180


def schema_problems(workflows: list[str]) -> list[str]:
    """What check-jsonschema finds wrong in the workflows (empty: all valid)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.github-workflows",
            *workflows,
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode == 0:
        return []
    return [f"schema: {line}" for line in (result.stdout + result.stderr).splitlines() if line]


def _python_option(argv: list[str]) -> list[str]:
    for i, word in enumerate(argv):
        if word in ("--python", "-p", "--pythons") and i + 1 < len(argv):
            return [argv[i + 1]]
        if word.startswith("--python="):
            return [word.split("=", 1)[1]]
    return []


def selection_problems(workflows: list[str], noxfile: str = "noxfile.py") -> list[str]:
    """Each workflow nox command, per matrix cell, that selects no session (or a wrong one)."""
    problems, seen = [], set()
    for workflow in workflows:
        for command in nox_commands(workflow):
            argv = command["argv"][1:]
            if "--" in argv:
                argv = argv[: argv.index("--")]
            key = (workflow, tuple(argv))
            if key in seen:
                continue
            seen.add(key)
            cell = json.dumps(command["cell"])
            where = f"{workflow} job {command['job']} {cell}: nox {' '.join(argv)}"
            listed = subprocess.run(
                [sys.executable, "-m", "nox", "-f", noxfile, "--list", "--json", *argv],
                capture_output=True,
                text=True,
            )
            if listed.returncode != 0:
                problems.append(f"{where}: nox failed: {listed.stderr.strip()[-300:]}")
                continue
            sessions = json.loads(listed.stdout or "[]")
            if not sessions:
                problems.append(f"{where}: selects no session")
                continue
            wanted = _python_option(argv)
            wrong = [s["session"] for s in sessions if wanted and s["python"] not in wanted]
            if wrong:
                problems.append(f"{where}: selects {wrong}, not on Python {wanted[0]}")
    return problems


# -------------------------------------------------------------- runner labels


def load_runner_images(path=RUNNER_IMAGES) -> dict:
    """The runner-label table: ``{"checked": date, "runners": {label: entry}}``."""
    data = tomllib.loads(Path(path).read_text())
    return {"checked": data["checked"], "runners": {r["label"]: r for r in data["runner"]}}


def is_retired(entry: dict, today: datetime.date) -> bool:
    """Whether GitHub no longer runs this label: marked retired, or its announced day has come."""
    retirement = entry.get("retirement")
    return entry["status"] == "retired" or (retirement is not None and retirement <= today)


def job_runner_labels(workflow_path) -> list[dict]:
    """Each job's ``runs-on``, resolved for each cell of its matrix.

    Each item: ``{"job", "cell", "matrix_keys", "labels", "exempt", "error"}``:
    ``matrix_keys``, the matrix variables ``runs-on`` reads (``os`` for
    ``${{ matrix.os }}``); ``labels``, the GitHub-hosted labels to check;
    ``exempt``, why there are none to check (a self-hosted runner, a runner
    group); ``error``, why ``runs-on`` cannot be resolved before the workflow
    runs (a matrix computed at run time, ...).
    """
    workflow = load_workflow(workflow_path)
    found = []
    for job_name, job in (workflow.get("jobs") or {}).items():
        if "uses" in job:  # a reusable workflow's call: its jobs say where they run
            continue
        for cell, error in _cells(job):
            item = {
                "job": job_name,
                "cell": cell,
                "matrix_keys": _matrix_keys(job.get("runs-on")),
                "labels": [],
                "exempt": None,
                "error": error,
            }
            if error is None:
                context = context_for(workflow, cell, event="workflow_dispatch")
                _resolve_runs_on(job.get("runs-on"), context, item)
            found.append(item)
    return found


def _matrix_keys(runs_on) -> list[str]:
    return list(dict.fromkeys(re.findall(r"\bmatrix\.([A-Za-z_][A-Za-z0-9_-]*)", str(runs_on))))


def _cells(job: dict) -> list[tuple[dict, str | None]]:
    matrix = (job.get("strategy") or {}).get("matrix")
    if matrix is None:
        return [({}, None)]
    computed = not isinstance(matrix, dict) or any(
        not isinstance(values, list) for values in matrix.values()
    )
    if computed:  # `matrix: ${{ fromJSON(...) }}`: known only when the workflow runs
        return [({}, f"its matrix is computed at run time ({matrix!r})")]
    return [(cell, None) for cell in matrix_cells(job)]


def _resolve_runs_on(runs_on, context: dict, item: dict) -> None:
    try:
        value = interpolate(runs_on, context)
    except ExpressionError as exc:
        item["error"] = f"runs-on {runs_on!r} cannot be resolved here: {exc}"
        return
    if isinstance(value, dict):  # {group: ..., labels: ...}
        if value.get("group"):
            item["exempt"] = f"runner group {value['group']!r}"
            return
        value = value.get("labels")
    labels = [str(label) for label in (value if isinstance(value, list) else [value]) if label]
    if not labels:
        item["error"] = f"runs-on {runs_on!r} names no runner"
    elif "self-hosted" in labels:
        item["exempt"] = "self-hosted"
    else:
        item["labels"] = labels


def _replacements(runners: dict, retired: str, today: datetime.date) -> list[str]:
    # Current labels of the same system ("macos", "ubuntu", "windows") and architecture.
    system, arch = retired.split("-")[0], runners[retired]["arch"]
    return sorted(
        label
        for label, entry in runners.items()
        if label.split("-")[0] == system and entry["arch"] == arch and not is_retired(entry, today)
    )


def _label_problem(label: str, table: dict, today: datetime.date) -> str | None:
    runners = table["runners"]
    entry = runners.get(label)
    if entry is None:
        return (
            f"runs-on {label!r} is not a GitHub-hosted label scripts/runner_images.toml knows "
            f"(checked {table['checked']}): a typo, an image to add to the table with its "
            "source, or a self-hosted runner, whose runs-on must list 'self-hosted'"
        )
    if not is_retired(entry, today):
        return None
    when = entry.get("retirement", "?")
    instead = ", ".join(_replacements(runners, label, today))
    return (
        f"runs-on {label!r} ({entry['image']}) was retired by GitHub on {when} "
        f"({entry['source']}); current {entry['arch']} labels: {instead or 'none'}"
    )


def runner_problems(
    workflows: list[str], table: dict | None = None, today: datetime.date | None = None
) -> list[str]:
    """Each job whose GitHub-hosted ``runs-on`` label is retired or unknown, once per label.

    A label a matrix feeds is named with the matrix values that gave it
    (``job tests (matrix os=macos-14)``), not with every cell it appears in.
    """
    table = table or load_runner_images()
    today = today or datetime.date.today()
    problems = []
    for workflow in workflows:
        for item in job_runner_labels(workflow):
            where = f"{workflow} job {item['job']}{_feeding_cell(item)}"
            found = [item["error"]] if item["error"] else []
            found += [_label_problem(label, table, today) for label in item["labels"]]
            problems += [f"{where}: {problem}" for problem in found if problem]
    return list(dict.fromkeys(problems))


def _feeding_cell(item: dict) -> str:
    values = [f"{key}={item['cell'][key]}" for key in item["matrix_keys"] if key in item["cell"]]
    return f" (matrix {', '.join(values)})" if values else ""


def stale_note(table: dict, today: datetime.date | None = None) -> str | None:
    """A reminder when the table has not been checked against GitHub for a while."""
    today = today or datetime.date.today()
    age = (today - table["checked"]).days
    if age <= STALE_AFTER_DAYS:
        return None
    return (
        f"note: scripts/runner_images.toml was last checked {table['checked']} ({age} days "
        "ago): check https://github.com/actions/runner-images#available-images and its "
        "announcements, then update it"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workflows", nargs="*", default=WORKFLOWS)
    parser.add_argument("--noxfile", default="noxfile.py")
    args = parser.parse_args(argv)
    table = load_runner_images()
    problems = (
        schema_problems(args.workflows)
        + runner_problems(args.workflows, table)
        + selection_problems(args.workflows, args.noxfile)
    )
    for problem in problems:
        print(problem)
    note = stale_note(table)
    if note:
        print(note)
    if not problems:
        print(
            f"{len(args.workflows)} workflows: valid, on current runners "
            f"(runner table checked {table['checked']}), every nox command selects its sessions"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
