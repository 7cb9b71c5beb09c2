"""The ``tqbatch`` command line: one argparse parser, sub-commands discovered.

Each module of :mod:`tqbatch.commands` is a sub-command. It defines
``register(subparsers)``, which adds its sub-parser and calls
``set_defaults(func=run)``, and ``run(args) -> int``, whose return value is
the process exit code. Discovery (rather than a hand-kept list) lets each
command live in its own module without touching this one.

Every command takes ``--precision`` and ``--device``. The precision is read
from the command line before any command module (and so mlx) is imported,
and every command runs only after the backend passed its known-answer check
(``tqbatch.testing.backend``); the check's result is ``args.backend``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import tqbatch
import tqbatch.commands
from tqbatch.commands import add_backend_arguments
from tqbatch.testing import backend

EXIT_BACKEND = 3  # the backend failed its known-answer check: no verdict possible


def command_modules() -> list:
    """The modules of :mod:`tqbatch.commands`, imported, in name order."""
    return [
        importlib.import_module(f"{tqbatch.commands.__name__}.{info.name}")
        for info in sorted(pkgutil.iter_modules(tqbatch.commands.__path__), key=lambda i: i.name)
        if not info.name.startswith("_")
    ]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every discovered sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="tqbatch",
        description="Check, fuzz and benchmark batched quantized KV caches.",
    )
    parser.add_argument("--version", action="version", version=f"tqbatch {tqbatch.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in command_modules():
        module.register(subparsers)
    for command in subparsers.choices.values():
        add_backend_arguments(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the sub-command, return its exit code."""
    early = argparse.ArgumentParser(add_help=False)
    add_backend_arguments(early)
    chosen, _ = early.parse_known_args(argv)
    try:
        backend.select_precision(chosen.precision)  # before build_parser imports mlx
    except backend.BackendError as exc:
        print(f"tqbatch: {exc}", file=sys.stderr)
        return EXIT_BACKEND
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        backend.select_device(args.device)
        args.backend = backend.check_backend()
    except backend.BackendError as exc:
        print(f"tqbatch: {exc}", file=sys.stderr)
        return EXIT_BACKEND
    from tqbatch.testing.impl import ImplSpecError

    try:
        return int(func(args) or 0)
    except ImplSpecError as exc:  # a bad --impl / target: one line, the same for every command
        print(f"tqbatch {args.command}: {exc}", file=sys.stderr)
        return 2


def console_main() -> None:
    """Entry point that exits the process with :func:`main`'s return code."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
