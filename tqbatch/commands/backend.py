"""``tqbatch backend``: run the backend's known-answer check and say what it found.

Every command runs the check before it starts (``tqbatch.cli``); this one
only reports it, so a CI workflow can pick the device that passes
(``tqbatch backend --device gpu || ...``). Exit 0 when the check passes,
3 when it fails (``tqbatch.exitcodes``). It needs none of the harness extra.

Pass or fail, it says what it saw (the device's name, memory and working set,
the lane, each kernel case's result and time, a retried pipeline build, the
kernels launched) on stdout, in ``$GITHUB_STEP_SUMMARY`` under GitHub Actions,
and with ``--report FILE`` as JSON: a CI job uploads that file, so the first
run on a new machine tells what its GPU did.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqbatch.commands import md_cell, step_summary
from tqbatch.exitcodes import ExitCode


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "backend",
        help="check that MLX computes known answers on this device and precision",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--report", type=Path, metavar="FILE", help="also write the report to FILE as JSON"
    )
    parser.set_defaults(func=run, checks_backend=True)


def run(args: argparse.Namespace) -> int:
    from tqbatch.testing import backend

    failure = None
    try:
        backend.check_backend()
    except backend.BackendError as exc:
        failure = str(exc)
    report = backend_report(failure)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    step_summary(markdown(report))
    if args.json:
        print(json.dumps(report))
    elif failure is None:
        print(f"backend OK: {backend.describe_line(report['backend'])}")
    if failure is not None:
        print(f"tqbatch: {failure}", file=sys.stderr)
        return ExitCode.BACKEND
    return ExitCode.OK


def backend_report(failure: str | None) -> dict:
    """What the check saw, as one JSON-ready record."""
    from tqbatch.testing import backend

    try:
        info = backend.describe()
    except backend.BackendError as exc:  # the precision measurement itself failed
        info = {"device": backend.select_device(), "error": str(exc)}
    return {
        "passed": failure is None,
        "failure": failure,
        "backend": info,
        "memory": backend.device_memory(),
        "kernel_check": backend.kernel_report(),
    }


def markdown(report: dict) -> str:
    """The report as a step summary: a verdict line, the device, each kernel case."""
    info = report["backend"]
    lane = info.get("lane") or {}
    memory = report["memory"]
    verdict = "passed" if report["passed"] else "FAILED"
    lines = [
        f"### tqbatch backend check on the {info.get('device')} lane: {verdict}",
        "",
        "| | |",
        "|---|---|",
        f"| device | {md_cell(info.get('device_name', info.get('device')))} |",
        f"| mlx | {md_cell(info.get('mlx', '-'))} |",
        f"| float32 matmuls at | {md_cell(info.get('matmul_precision', '-'))} |",
        f"| memory | {md_cell(_gib(memory.get('memory_size')))} |",
        f"| working set | {md_cell(_gib(memory.get('max_recommended_working_set_size')))} |",
        f"| lane | {md_cell(lane.get('lane', '-'))} |",
        f"| mlx-vlm | {md_cell(lane.get('mlx_vlm_metal', '-'))} |",
        f"| kernels | {md_cell(info.get('kernels', '-'))} |",
        f"| kernels launched | {md_cell(_launches(lane.get('kernels_launched') or {}))} |",
    ]
    check = report["kernel_check"]
    if check is not None:
        if check["retried_after"]:
            lines += ["", f"Retried once after: {md_cell('; '.join(check['retried_after']))}"]
        lines += ["", "| kernel case | result | seconds |", "|---|---|---|"]
        for case in check["cases"]:
            result = "pass" if case["passed"] else "; ".join(case["problems"])
            lines.append(f"| {md_cell(case['case'])} | {md_cell(result)} | {case['seconds']} |")
    if report["failure"]:
        lines += ["", "```", report["failure"], "```"]
    return "\n".join(lines)


def _gib(size) -> str:
    return "-" if size is None else f"{size / 2**30:.1f} GiB"


def _launches(launched: dict[str, int]) -> str:
    return ", ".join(f"{name} x{count}" for name, count in launched.items()) or "none"
