"""``tqbatch backend``: run the backend's known-answer check and say what it found.

Every command runs the check before it starts (``tqbatch.cli``); this one
only reports it, so a CI workflow can pick the device that passes
(``tqbatch backend --device gpu || ...``). Exit 0 when the check passes,
3 when it fails (``tqbatch.exitcodes``). It needs none of the harness extra.
"""

from __future__ import annotations

import argparse
import json

from tqbatch.exitcodes import ExitCode


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "backend",
        help="check that MLX computes known answers on this device and precision",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--json", action="store_true", help="print the description as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqbatch.testing.backend import describe_line

    print(json.dumps(args.backend) if args.json else f"backend OK: {describe_line(args.backend)}")
    return ExitCode.OK
