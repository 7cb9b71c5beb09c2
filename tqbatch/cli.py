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

Exit codes are ``tqbatch.exitcodes.ExitCode``, the same map for every
command. This frame produces three of them itself: 2 for a usage error or a
target that does not load, 3 when the backend fails its check, and 4 when a
package of the ``harness`` extra is missing (one line naming the extra, where
the command first imports it). Commands run with Hypothesis's storage
directory in a temporary directory, so that they leave nothing in the current
directory but what was asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import tqbatch
import tqbatch.commands
from tqbatch.commands import add_backend_arguments
from tqbatch.exitcodes import ExitCode, harness_message, missing_harness
from tqbatch.testing import backend

HYPOTHESIS_HOME_ENV = "HYPOTHESIS_STORAGE_DIRECTORY"


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
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the sub-command, return its exit code.

    A target ``MODULE:CLASS`` is imported as ``python -m tqbatch`` would find it:
    with the current directory on ``sys.path`` (the ``tqbatch`` script alone
    does not put it there), so that ``tqbatch replay FILE`` in a project finds
    the project's cache as its tests did.
    """
    here = os.getcwd()
    added = "" not in sys.path and here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        return _main(argv)
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


def _main(argv: Sequence[str] | None) -> int:
    early = argparse.ArgumentParser(add_help=False)
    add_backend_arguments(early)
    chosen, _ = early.parse_known_args(argv)
    try:
        backend.select_precision(chosen.precision)  # before build_parser imports mlx
    except backend.BackendError as exc:
        print(f"tqbatch: {exc}", file=sys.stderr)
        return ExitCode.BACKEND
    try:
        parser = build_parser()
    except ImportError as exc:  # a command module that imports the harness at import time
        if (package := missing_harness(exc)) is None:
            raise
        print(harness_message(None, package), file=sys.stderr)
        return ExitCode.NO_HARNESS
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return ExitCode.USAGE
    try:
        backend.select_device(args.device)
        # `tqbatch backend` runs the check itself, to report a failure too.
        args.backend = None if getattr(args, "checks_backend", False) else backend.check_backend()
    except backend.BackendError as exc:
        print(f"tqbatch: {exc}", file=sys.stderr)
        return ExitCode.BACKEND
    from tqbatch.testing.target import ImplSpecError

    try:
        with hypothesis_home_outside_cwd():
            return int(func(args) or 0)
    except ImplSpecError as exc:  # a bad --impl / target: one line, the same for every command
        print(f"tqbatch {args.command}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except ImportError as exc:
        # Only a missing harness package is an install problem; any other
        # missing module is a bug, with its traceback.
        if (package := missing_harness(exc)) is None:
            raise
        print(harness_message(args.command, package), file=sys.stderr)
        return ExitCode.NO_HARNESS


@contextlib.contextmanager
def hypothesis_home_outside_cwd() -> Iterator[None]:
    """Point Hypothesis's storage directory at a temporary directory for a command.

    Hypothesis writes ``.hypothesis/`` (e.g. its cache of the constants in
    local source files) in the current directory by default, and a command
    must leave nothing there that the user did not ask for. The variable is
    inherited by the pytest-xdist shards of ``fuzz --workers``. Where
    ``$HYPOTHESIS_STORAGE_DIRECTORY`` is set, that is the user's choice and is
    kept; an example database given by path (``fuzz --database``) is not in
    the storage directory and is kept too.
    """
    if os.environ.get(HYPOTHESIS_HOME_ENV):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="tqbatch-hypothesis-") as home:
        os.environ[HYPOTHESIS_HOME_ENV] = home
        try:
            yield
        finally:
            del os.environ[HYPOTHESIS_HOME_ENV]
            # Hypothesis reads the variable once and keeps the path: forget it,
            # or a later use in this process would write to a deleted directory.
            configuration = sys.modules.get("hypothesis.configuration")
            if configuration is not None:
                current = configuration.storage_directory(intent_to_write=False)
                if current.home_directory == Path(home):
                    configuration.set_hypothesis_home_dir(None)


def console_main() -> None:
    """Entry point that exits the process with :func:`main`'s return code."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
