"""Trace what the state machine draws and finds, per target, to show a change keeps verdicts.

For each target (tqbatch's cache, mlx-vlm's class and every mutant of
``tqbatch.testing.mutants``) the machine runs under ``derandomize=True``
(the ``ci`` profile's steps, 30 examples, generate phase only, no
database), with every check failure tolerated so that each example runs to
its end or to the point where the target has diverged. Per example it
records a SHA-256 of the ops applied (JSON, keys sorted), the identities
of the checks that failed in it, and how many reference tokens took the
target's other rounding choice (``World.refs.admitted``: sensitive to the
oracle's numbers); per target, the verdict: every identity found, and the
error that ended the run, if any (a harness crash or an unsupported op).

Run it before and after a change that should not alter the search and
compare the two files::

    python scripts/trace_verdicts.py --out /tmp/before.json
    python scripts/trace_verdicts.py --out /tmp/after.json
    python scripts/trace_verdicts.py --compare /tmp/before.json /tmp/after.json

Seconds are recorded per target but left out of the comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import warnings

from hypothesis import HealthCheck, Phase, settings

import tqbatch
from tqbatch.testing.backend.codebooks import fast_codebooks
from tqbatch.testing.mutants import MUTANTS
from tqbatch.testing.search import hypothesis_internals
from tqbatch.testing.search.machine_observer import MachineObserver
from tqbatch.testing.search.profiles import PROFILES
from tqbatch.testing.search.stateful import UnsupportedOpsWarning, machine_for
from tqbatch.testing.target import ALIASES, load_impl

EXAMPLES = 30


def targets() -> dict[str, type]:
    """tqbatch's cache, mlx-vlm's class and every mutant, by name."""
    out = {"tqbatch": tqbatch.BatchTurboQuantKVCache, "mlx-vlm": load_impl(ALIASES["mlx-vlm"])}
    out.update(sorted(MUTANTS.items()))
    return out


def ops_digest(ops: list[dict]) -> str:
    return hashlib.sha256(json.dumps(ops, sort_keys=True).encode()).hexdigest()


def trace(impl: type, examples: int = EXAMPLES) -> dict:
    """One target's examples (ops digest, identities, admitted tokens) and its verdict."""
    observer = MachineObserver()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsupportedOpsWarning)
        machine = machine_for(impl, tolerate=lambda failure: True, observer=observer)
    records = []

    class Tracing(machine):
        def teardown(self):
            world = self.world
            if world is None:
                records.append({"ops": ops_digest([]), "failed": [], "admitted": 0})
                return
            failed = sorted({f.identity for f in world.tolerated})
            records.append(
                {"ops": ops_digest(world.ops), "failed": failed, "admitted": world.refs.admitted}
            )

    Tracing.TestCase.settings = settings(
        PROFILES["ci"],
        max_examples=examples,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        report_multiple_bugs=False,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    start = time.perf_counter()
    error = None
    try:
        # As run_campaign runs the machine: no constants from local code, and
        # the codebooks solved by the harness's solve.
        with hypothesis_internals.no_local_constants(), fast_codebooks():
            Tracing.TestCase("runTest").runTest()
    except BaseException as exc:  # noqa: BLE001 - what ended the run is part of the trace
        if isinstance(exc, KeyboardInterrupt):
            raise
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    found = sorted({identity for r in records for identity in r["failed"]})
    return {
        "examples": records,
        "verdict": found,
        "error": error,
        "seconds": round(time.perf_counter() - start, 1),
    }


def compare(before: dict, after: dict) -> list[str]:
    """Differences between two traces (seconds left out); empty where they agree."""
    diffs = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            diffs.append(f"{name}: only in {'after' if a is None else 'before'}")
            continue
        for key in ("verdict", "error"):
            if a[key] != b[key]:
                diffs.append(f"{name}: {key} {a[key]!r} -> {b[key]!r}")
        if len(a["examples"]) != len(b["examples"]):
            diffs.append(f"{name}: {len(a['examples'])} -> {len(b['examples'])} examples")
        for i, (x, y) in enumerate(zip(a["examples"], b["examples"])):
            if x != y:
                diffs.append(f"{name}: example {i}: {x} -> {y}")
    return diffs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the trace here (JSON)")
    parser.add_argument("--examples", type=int, default=EXAMPLES)
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("names", nargs="*", help="targets to trace (default: all)")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.load(open(path))["targets"] for path in args.compare)
        diffs = compare(before, after)
        examples = sum(len(t["examples"]) for t in before.values())
        print("\n".join(diffs) or f"identical: {len(before)} targets, {examples} examples")
        return 1 if diffs else 0
    everything = targets()
    names = args.names or list(everything)
    out = {}
    for name in names:
        out[name] = trace(everything[name], args.examples)
        print(
            f"{name}: {len(out[name]['examples'])} examples, verdict {out[name]['verdict']}, "
            f"{out[name]['seconds']} s",
            file=sys.stderr,
            flush=True,
        )
    data = {"examples_per_target": args.examples, "targets": out}
    text = json.dumps(data, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
