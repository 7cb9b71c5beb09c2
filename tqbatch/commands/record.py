"""``tqbatch record [PATH...]``: (re-)record golden scenarios, explicitly.

Without a path it records the golden scenarios shipped with tqbatch
(``tqbatch.testing.replay.golden``: in a checkout, the files under version control).

Recording is never done by a test run: only this command (and the nox
``golden -- --regen`` session, which calls it with ``--all``) writes ``.npz``
recordings. It refuses to record a target that diverges from the oracles.

Exit codes (``tqbatch.exitcodes``): 0 every scenario recorded or up to
date; 1 the target was refused (it diverges from the oracles: a defect); 2
a missing path, a malformed scenario or a target that does not load; 3 the
backend failed its check; 5 no scenario file under the paths (nothing to
record).
"""

from __future__ import annotations

import sys

from tqbatch.commands import add_impl_argument
from tqbatch.exitcodes import ExitCode
from tqbatch.testing.replay import golden
from tqbatch.testing.target import ImplSpecError, load_impl


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "record",
        help="record golden scenarios' expectations (.npz) from a target",
        description=(
            "Replay scenarios against the target with the live oracles and write their "
            "recordings. By default only scenarios without an up-to-date recording are "
            "recorded; --all re-records every one. Refuses if the target diverges from "
            "the oracles (a recording must never pin a bug)."
        ),
    )
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="scenario .json or directory (default: the golden scenarios shipped with tqbatch)",
    )
    parser.add_argument(
        "--all", action="store_true", help="re-record scenarios whose recording is up to date"
    )
    add_impl_argument(parser, "cache to record from")
    parser.set_defaults(func=run)


def record_paths(paths, *, everything: bool = False, impl: str | None = None) -> int:
    """Record the scenarios under ``paths``; the exit code (see the module docstring)."""
    # Imported here: the executor needs the harness extra, the parser must not.
    from tqbatch.testing.replay.recorder import RecordError, needs_recording, record
    from tqbatch.testing.replay.scenario import Scenario, ScenarioError, discover

    try:
        cls = load_impl(impl)
        scenarios = [Scenario.load(p) for p in discover(paths or [golden.DIRECTORY])]
    except (ImplSpecError, ScenarioError) as err:
        print(f"tqbatch record: {err}", file=sys.stderr)
        return ExitCode.USAGE
    if not scenarios:
        print("tqbatch record: no scenario files found", file=sys.stderr)
        return ExitCode.NOTHING_CHECKED
    refused = 0
    for scenario in scenarios:
        if not everything and not needs_recording(scenario):
            print(f"up to date {scenario.path}")
            continue
        try:
            npz = record(scenario, cls)
        except RecordError as err:
            print(f"REFUSED {err}", file=sys.stderr)
            refused += 1
            continue
        print(f"recorded {npz}")
    return ExitCode.DEFECT if refused else ExitCode.OK


def run(args) -> int:
    return record_paths(args.paths, everything=args.all, impl=args.impl)
