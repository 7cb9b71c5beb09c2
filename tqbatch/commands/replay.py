"""``tqbatch replay [PATH...]``: replay golden scenarios; non-zero exit on divergence.

Without a path it replays the golden scenarios shipped with tqbatch
(``tqbatch.testing.golden``).

Exit codes (``tqbatch.exitcodes``): 0 every scenario that ran replayed
green (scenarios skipped because the target lacks an operation they need are
counted and listed, as ``fuzz`` skips rules a target cannot run); 1 at least
one diverged; 2 bad arguments, a missing path, a malformed scenario or a
target that does not load; 3 the backend failed its check; 5 nothing was
checked: no scenario under the paths (an empty directory), or every one was
skipped. Under GitHub Actions the counts and the diverged scenarios are also
appended to ``$GITHUB_STEP_SUMMARY``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tqbatch.commands import add_impl_argument, md_cell, step_summary
from tqbatch.exitcodes import ExitCode
from tqbatch.testing import golden
from tqbatch.testing.backend import describe_line
from tqbatch.testing.impl import ImplSpecError, load_impl
from tqbatch.testing.scenario import ScenarioError, discover, replay


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="replay golden scenarios against a target; exit 1 on divergence",
        description=(
            "Replay scenario files (or every scenario under a directory) against the "
            "target, checking the live oracles after every op and comparing every "
            "observation with the scenario's recording. Exit 0 if all that ran replay green, "
            "1 if any diverges, 2 on bad input, 5 if none ran (none found, or all skipped "
            "for unsupported ops)."
        ),
    )
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="scenario .json or directory (default: the golden scenarios shipped with tqbatch)",
    )
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
        paths = discover(args.paths or [golden.DIRECTORY])
    except (ImplSpecError, ScenarioError) as err:
        print(f"tqbatch replay: {err}", file=sys.stderr)
        return ExitCode.USAGE
    if not paths:
        print("tqbatch replay: no scenario files found: nothing was checked", file=sys.stderr)
        step_summary("### tqbatch replay\n\nno scenario files found: nothing was checked")
        return ExitCode.NOTHING_CHECKED
    print(f"backend: {describe_line(args.backend)}")
    skipped = 0
    diverged = []
    for path in paths:
        try:
            result = replay(path, impl, use_recording=not args.oracles_only)
        except ScenarioError as err:
            print(f"ERROR {path}: {err}", file=sys.stderr)
            return ExitCode.USAGE
        print(result.summary(), flush=True)
        if not result.ok and result.skipped is None:  # diverged: at its first divergence
            diverged.append(f"`{result.scenario.name}`: {md_cell(result.divergences[0])}")
        skipped += result.skipped is not None
        if args.save_observed:
            out = Path(args.save_observed)
            out.mkdir(parents=True, exist_ok=True)
            np.savez(out / f"{result.scenario.name}.observed.npz", **result.observed)
    total, failed = len(paths), len(diverged)
    counts = f"{total - failed - skipped} passed, {failed} diverged, {skipped} skipped"
    print(counts)
    if failed:
        code = ExitCode.DEFECT
    elif skipped == total:
        print("every scenario was skipped: nothing was checked", file=sys.stderr)
        code = ExitCode.NOTHING_CHECKED
    else:
        code = ExitCode.OK
    summary = [f"### tqbatch replay\n\nexit {int(code)}: {code.meaning}; {counts}"]
    summary += [f"- {line}" for line in diverged]
    step_summary("\n".join(summary))
    return code
