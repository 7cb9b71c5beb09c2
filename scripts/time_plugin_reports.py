"""Seconds from ``pytest`` starting to its first reported failure, per mutant, through the plugin.

What a cache owner's CI waits for: each mutant of ``tqbatch.testing.mutants``
(a cache that re-introduces one historical bug) is run as

    python -m pytest --pyargs tqbatch.conformance --tqbatch-impl tqbatch.testing.mutants:NAME

in its own process with ``CI=true`` (so the ``ci`` profile), from an empty
directory, and timed from the process's start to the first line that reports
a failure: a test's ``FAILED`` line (``-v``) or the survey's live
``tqbatch survey: ... found`` line. Then the process is stopped.

``--only-state-machine`` runs ``-k test_state_machine`` alone, so the time is
the search's, not the golden scenarios' (which were written to kill these very
mutants and report them within seconds: a bug nobody has written a scenario
for yet gets the survey only).

    python scripts/time_plugin_reports.py --only-state-machine --markdown
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

LIMIT = 300.0  # seconds: a mutant not reported by then is "not found"


def first_report(name: str, *, only_state_machine: bool, cwd: Path) -> tuple[float | None, str]:
    """Seconds to the first reported failure for mutant ``name`` and the line that reported it."""
    command = [sys.executable, "-m", "pytest", "--pyargs", "tqbatch.conformance", "-v"]
    command += ["-p", "no:cacheprovider", "--tqbatch-impl", f"tqbatch.testing.mutants:{name}"]
    command += ["--tqbatch-failures", str(cwd / f"failures-{name}")]
    if only_state_machine:
        command += ["-k", "test_state_machine"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TQBATCH_"))}
    env["CI"] = "true"
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        for line in process.stdout:
            seconds = time.monotonic() - start
            reported = line.startswith("tqbatch survey:") or (" FAILED" in line and "::" in line)
            if reported:
                return seconds, line.strip()
            if seconds > LIMIT:
                break
        return None, ""
    finally:
        process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutants", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--only-state-machine", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    from tqbatch.testing.mutants import MUTANTS

    names = args.mutants or sorted(MUTANTS)
    unknown = sorted(set(names) - set(MUTANTS))
    if unknown:
        parser.error(f"no such mutant: {', '.join(unknown)}")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            seconds, line = first_report(
                name, only_state_machine=args.only_state_machine, cwd=Path(scratch)
            )
            rows.append((name, seconds, line))
            if not args.markdown:
                shown = "not found" if seconds is None else f"{seconds:6.1f} s"
                print(f"{name:34s} {shown}  {line[:110]}", flush=True)
    found = [s for _, s, _ in rows if s is not None]
    summary = f"{len(found)}/{len(rows)} reported" + (
        f"; median {statistics.median(found):.1f} s, max {max(found):.1f} s" if found else ""
    )
    if args.markdown:
        print("| mutant | first report (s) | reported as |")
        print("|---|---|---|")
        for name, seconds, line in rows:
            shown = "not found" if seconds is None else f"{seconds:.1f}"
            # "tqbatch survey: IDENTITY [level] found, ..." or "path::test[id] FAILED [ 8%]"
            what = line.removeprefix("tqbatch survey: ").split(" [")[0].split(" FAILED")[0]
            print(f"| {name} | {shown} | `{what.split('::')[-1] or '-'}` |")
        print()
    print(summary)
    return 0 if len(found) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
