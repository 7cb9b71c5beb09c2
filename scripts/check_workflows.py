"""Check the GitHub workflows before GitHub runs them: schema, and what their nox commands select.

    python scripts/check_workflows.py [WORKFLOW...] [--noxfile noxfile.py]

Two checks, each of which has failed a workflow that looked fine:

1. **Schema**: every workflow validates against GitHub's workflow schema
   (check-jsonschema's vendored copy, offline): unknown keys, wrong types,
   a bad ``on:`` trigger.
2. **nox selection**: every ``nox`` command in a workflow, expanded for each
   cell of its job's matrix, selects at least one session, and each selected
   session runs on the Python the command names. (``nox -s tests --python
   3.12`` against sessions that declare no Python selects nothing and fails,
   and did, on every cell.) The selection is nox's own: ``nox --list --json``.

Exit 0 when both pass, 1 listing every problem otherwise. ``nox -s lint`` runs
this; ``tests/unit/test_workflows.py`` runs it on the real files and on broken
copies.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_workflow import nox_commands  # noqa: E402

WORKFLOWS = sorted(str(p) for p in Path(".github/workflows").glob("*.yml"))


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workflows", nargs="*", default=WORKFLOWS)
    parser.add_argument("--noxfile", default="noxfile.py")
    args = parser.parse_args(argv)
    problems = schema_problems(args.workflows) + selection_problems(args.workflows, args.noxfile)
    for problem in problems:
        print(problem)
    if not problems:
        print(f"{len(args.workflows)} workflows: valid, every nox command selects its sessions")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
