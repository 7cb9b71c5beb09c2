"""``tqbatch replay PATH...``: replay golden scenarios; non-zero exit on divergence."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tqbatch.commands import add_impl_argument
from tqbatch.testing.backend import describe_line
from tqbatch.testing.impl import ImplSpecError, load_impl
from tqbatch.testing.scenario import ScenarioError, discover, replay

# Exit codes: 0 every scenario replayed green; 1 at least one diverged;
# 2 bad arguments or a malformed scenario; 3 nothing failed but some were
# skipped (the target lacks an operation they need).
EXIT_OK, EXIT_DIVERGED, EXIT_USAGE, EXIT_SKIPPED = 0, 1, 2, 3


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="replay golden scenarios against a target; exit 1 on divergence",
        description=(
            "Replay scenario files (or every scenario under a directory) against the "
            "target, checking the live oracles after every op and comparing every "
            "observation with the scenario's recording. Exit 0 if all replay green, 1 if "
            "any diverges, 2 on bad input, 3 if some were skipped (unsupported ops)."
        ),
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="scenario .json or directory")
    add_impl_argument(parser)
    parser.add_argument(
        "--oracles-only",
        action="store_true",
        help="ignore recordings; check only against the live oracles (unrecorded failures)",
    )
    parser.add_argument(
        "--save-observed",
        metavar="DIR",
        help="write what was observed as DIR/NAME.observed.npz (e.g. to diff two machines)",
    )
    parser.set_defaults(func=run)


def run(args) -> int:
    try:
        impl = load_impl(args.impl)
        paths = discover(args.paths)
    except (ImplSpecError, ScenarioError) as err:
        print(f"tqbatch replay: {err}", file=sys.stderr)
        return EXIT_USAGE
    if not paths:
        print("tqbatch replay: no scenario files found", file=sys.stderr)
        return EXIT_USAGE
    print(f"backend: {describe_line(args.backend)}")
    failed = skipped = 0
    for path in paths:
        try:
            result = replay(path, impl, use_recording=not args.oracles_only)
        except ScenarioError as err:
            print(f"ERROR {path}: {err}", file=sys.stderr)
            return EXIT_USAGE
        print(result.summary(), flush=True)
        failed += not result.ok and result.skipped is None
        skipped += result.skipped is not None
        if args.save_observed:
            out = Path(args.save_observed)
            out.mkdir(parents=True, exist_ok=True)
            np.savez(out / f"{result.scenario.name}.observed.npz", **result.observed)
    total = len(paths)
    print(f"{total - failed - skipped} passed, {failed} diverged, {skipped} skipped")
    if failed:
        return EXIT_DIVERGED
    return EXIT_SKIPPED if skipped else EXIT_OK
