"""``tqbatch replay [PATH...]``: replay golden scenarios; non-zero exit on divergence.

Without a path it replays the golden scenarios shipped with tqbatch
(``tqbatch.testing.replay.golden``).

Exit codes (``tqbatch.exitcodes``): 0 every scenario that ran replayed
green (scenarios skipped because the target lacks an operation they need are
counted and listed, as ``fuzz`` skips rules a target cannot run); 1 at least
one diverged; 2 bad arguments, a missing path, a malformed scenario or a
target that does not load; 3 the backend failed its check; 5 nothing was
checked: no scenario under the paths (an empty directory), or every one was
skipped. Under GitHub Actions the counts and the diverged scenarios are also
appended to ``$GITHUB_STEP_SUMMARY``.

Which target each scenario replays against: ``--impl`` where given; else
the target a saved failure was found on (``found_on.options.impl``, written
by ``fuzz`` and ``conformance``), so that the failure reproduces where it
was found, and the command says so; else ``$TQBATCH_IMPL`` or tqbatch's own
cache. A recorded target that does not load is a usage error (2) naming it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tqbatch.commands import add_impl_argument, md_cell, step_summary
from tqbatch.exitcodes import ExitCode
from tqbatch.testing.backend import describe_line
from tqbatch.testing.replay import golden
from tqbatch.testing.target import ImplSpecError, load_impl


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
    add_impl_argument(
        parser,
        "cache to replay against",
        default="the target a saved failure was found on, else $TQBATCH_IMPL or tqbatch's own",
    )
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
    # Imported here: the executor needs the harness extra, the parser must not.
    from tqbatch.testing.replay.replayer import replay
    from tqbatch.testing.replay.scenario import Scenario, ScenarioError, discover

    try:
        explicit = load_impl(args.impl) if args.impl else None
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
    loaded: dict[str | None, type] = {}  # recorded target (None: none) -> its class
    for path in paths:
        recorded = None
        try:
            scenario = Scenario.load(path)
            impl = explicit
            if impl is None:
                recorded = _recorded_target(scenario)
                if recorded not in loaded:
                    loaded[recorded] = load_impl(recorded)  # None: $TQBATCH_IMPL or the default
                    if recorded is not None:
                        print(f"replaying against {recorded}: the target it was found on")
                impl = loaded[recorded]
            result = replay(scenario, impl, use_recording=not args.oracles_only)
        except ScenarioError as err:
            print(f"ERROR {path}: {err}", file=sys.stderr)
            return ExitCode.USAGE
        except ImplSpecError as err:
            where = f" ({path} was found on it; --impl replays it against another)"
            print(f"tqbatch replay: {err}{where if recorded else ''}", file=sys.stderr)
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


def _recorded_target(scenario) -> str | None:
    """The target a saved failure was found on (``module:Class``), or None (a golden scenario)."""
    options = (scenario.found_on or {}).get("options") or {}
    target = options.get("impl")
    return target if isinstance(target, str) and target else None
