"""Seconds from ``pytest`` starting to its first reported failure, and to the run going red.

What a cache owner's CI waits for: each mutant of ``tqbatch.testing.mutants``
(a cache that re-introduces one historical bug) is run as

    python -m pytest --pyargs tqbatch.conformance --tqbatch-impl tqbatch.testing.mutants:NAME

in its own process with ``CI=true`` (so the ``ci`` profile), from an empty
directory, and timed from the process's start to the first line that reports
a failure: a test's ``FAILED`` line (``-v``) or the survey's live
``tqbatch survey: ... found`` line (a policy difference is not one), and to
the process's end ("run red": exit 1), at most ``LIMIT`` seconds.
``--mlx-vlm-regressions`` runs ``tqbatch.testing.selfcheck.mlx_vlm_regressions``
instead, each with mlx-vlm's shipped known-failures list.

``--only-state-machine`` runs ``-k test_state_machine`` alone, so the time is
the search's, not the golden scenarios' (which were written to kill these very
mutants and report them within seconds: a bug nobody has written a scenario
for yet gets the survey only).

    python scripts/time_plugin_reports.py --only-state-machine --markdown

``--compare BEFORE AFTER`` runs nothing: it sets two such markdown tables
side by side, with whether each run went red within the goal (twice its
first report or 60 s, whichever is larger).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIMIT = 300.0  # seconds: a target not reported by then is "not found"
RED_FLOOR = 60.0  # seconds: the goal is the run red within max(2 x first report, this)
KNOWN_MLX_VLM = "mlx_vlm_0_7_10"  # the shipped list the mlx-vlm regressions run with


def time_run(
    impl: str, *, only_state_machine: bool, cwd: Path, known_failures: str | None = None
) -> tuple[float | None, str, float | None, int | None]:
    """Run the plugin against ``impl``: seconds to its first reported failure and that line,
    seconds to the run's end (None: still running at ``LIMIT``) and its exit code."""
    command = [sys.executable, "-m", "pytest", "--pyargs", "tqbatch.conformance", "-v"]
    command += ["-p", "no:cacheprovider", "--tqbatch-impl", impl]
    command += ["--tqbatch-failures", str(cwd / f"failures-{impl.rsplit(':', 1)[-1]}")]
    if known_failures:
        command += ["--tqbatch-known-failures", known_failures]
    if only_state_machine:
        command += ["-k", "test_state_machine"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TQBATCH_"))}
    env["CI"] = "true"
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first, what = None, ""
    try:
        for line in process.stdout:
            seconds = time.monotonic() - start
            reported = line.startswith("tqbatch survey:") or (" FAILED" in line and "::" in line)
            if reported and first is None and "[policy]" not in line:
                first, what = seconds, line.strip()
            if seconds > LIMIT:
                return first, what, None, None
        code = process.wait()
        return first, what, time.monotonic() - start, code
    finally:
        process.kill()
        process.wait()


def markdown_row(
    name: str, first: float | None, line: str, end: float | None, code: int | None
) -> str:
    """One table row: seconds to the first report, what it reported, seconds to the run red."""
    shown = "not found" if first is None else f"{first:.1f}"
    red = "-" if end is None or code != 1 else f"{end:.1f}"
    # "tqbatch survey: IDENTITY [level] found, ..." or "path::test[id] FAILED [ 8%]"
    what = line.removeprefix("tqbatch survey: ").split(" [")[0].split(" FAILED")[0]
    return f"| {name} | {shown} | `{what.split('::')[-1] or '-'}` | {red} |"


def read_table(path: str) -> dict[str, tuple[float | None, str, float | None]]:
    """A ``--markdown`` table: target -> (first report, reported as, run red), None for "-"."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("target", "---"):
            continue
        name, first, what, red = cells
        rows[name] = (_seconds(first), what, _seconds(red))
    return rows


def _seconds(cell: str) -> float | None:
    """A table cell's seconds; None for "-" or "not found"."""
    try:
        return float(cell)
    except ValueError:
        return None


def _shown(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def red_in_time(first: float | None, red: float | None) -> bool:
    return first is not None and red is not None and red <= max(2 * first, RED_FLOOR)


def compare(before_path: str, after_path: str) -> None:
    """Print the two tables side by side and how many runs went red within the goal."""
    before, after = read_table(before_path), read_table(after_path)
    print(
        "| target | first report (s), before | after | run red (s), before | after "
        f"| red within max(2x first, {RED_FLOOR:.0f} s) | reported as (after) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (first, what, red) in after.items():
        old_first, _, old_red = before.get(name, (None, "", None))
        within = "yes" if red_in_time(first, red) else "no"
        print(
            f"| {name} | {_shown(old_first)} | {_shown(first)} | {_shown(old_red)} | {_shown(red)} "
            f"| {within} | {what} |"
        )
    met = {
        label: sum(red_in_time(f, r) for f, _, r in rows.values())
        for label, rows in (("after", after), ("before", before))
    }
    print()
    print(
        f"Run red within the goal: {met['after']}/{len(after)} after; "
        f"before {met['before']}/{len(before)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutant (or regression) names (default: all)")
    parser.add_argument("--only-state-machine", action="store_true")
    parser.add_argument(
        "--mlx-vlm-regressions",
        action="store_true",
        help="the regressions of tqbatch.testing.selfcheck.mlx_vlm_regressions, with mlx-vlm's "
        f"shipped list ({KNOWN_MLX_VLM}), instead of tqbatch's mutants",
    )
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="set two --markdown tables side by side (runs nothing)",
    )
    args = parser.parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return 0
    if args.mlx_vlm_regressions:
        from tqbatch.testing.selfcheck import mlx_vlm_regressions as catalogue

        targets, known = catalogue.REGRESSIONS, KNOWN_MLX_VLM
    else:
        from tqbatch.testing import mutants as catalogue

        targets, known = catalogue.MUTANTS, None
    names = args.names or sorted(targets)
    unknown = sorted(set(names) - set(targets))
    if unknown:
        parser.error(f"no such target: {', '.join(unknown)}")
    rows = []
    if args.markdown:
        print("| target | first report (s) | reported as | run red (s) |")
        print("|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            first, line, end, code = time_run(
                f"{catalogue.__name__}:{name}",
                only_state_machine=args.only_state_machine,
                cwd=Path(scratch),
                known_failures=known,
            )
            rows.append((name, first, line, end, code))
            # Each row as it comes: a run cut short (a session's limit) keeps what it measured.
            if args.markdown:
                print(markdown_row(name, first, line, end, code), flush=True)
            else:
                shown = "not found" if first is None else f"{first:6.1f} s"
                ended = "running" if end is None else f"exit {code} at {end:.1f} s"
                print(f"{name:34s} {shown}  {ended}  {line[:90]}", flush=True)
    found = [first for _, first, _, _, code in rows if first is not None and code == 1]
    ends = [end for _, first, _, end, code in rows if first is not None and code == 1]
    summary = f"{len(found)}/{len(rows)} reported and failed the run" + (
        f"; first report median {statistics.median(found):.1f} s, max {max(found):.1f} s; "
        f"run ended median {statistics.median(ends):.1f} s, max {max(ends):.1f} s"
        if found
        else ""
    )
    if args.markdown:
        print()
    print(summary)
    return 0 if len(found) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
