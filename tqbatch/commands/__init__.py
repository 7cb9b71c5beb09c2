"""Sub-commands of the ``tqbatch`` CLI, one module each.

Every public module here defines ``register(subparsers)`` (adds its
sub-parser and ``set_defaults(func=run)``) and ``run(args) -> int`` (the exit
code). :mod:`tqbatch.cli` discovers them with :mod:`pkgutil`; modules whose
names start with ``_`` are helpers, not commands.

Output helpers shared by the commands: ``console`` (rich tables that CI logs
do not cut) and ``step_summary`` (a markdown summary for GitHub Actions).
"""

import os
import sys

from tqbatch.testing.backend import DEVICES, PRECISIONS

# Rich cuts and wraps to 80 columns where the stream is not a terminal (a CI
# log, a pipe), which cut identities such as rejects@extend-mixed-config in
# half. No table row of these commands comes near this width.
UNCUT_WIDTH = 4096
STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"


def console(stderr: bool = False):
    """A rich ``Console`` for tables and progress: the terminal's width on a terminal, else
    ``UNCUT_WIDTH`` so that nothing is cut or wrapped."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=UNCUT_WIDTH)


def step_summary(markdown: str) -> None:
    """Append ``markdown`` to GitHub Actions' job summary, where there is one.

    GitHub Actions sets ``$GITHUB_STEP_SUMMARY`` to a file whose markdown it
    shows on the run's page; elsewhere this does nothing. A summary that cannot
    be written is reported on stderr and does not change the exit code.
    """
    path = os.environ.get(STEP_SUMMARY_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(markdown.rstrip("\n") + "\n\n")
    except OSError as exc:
        print(f"tqbatch: cannot write the step summary ${STEP_SUMMARY_ENV}: {exc}", file=sys.stderr)


def md_cell(text) -> str:
    """``text`` as one markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|") or "-"


def add_impl_argument(
    parser,
    help: str = "cache under test",
    default: str = "$TQBATCH_IMPL or tqbatch.BatchTurboQuantKVCache",
) -> None:
    """The ``--impl MODULE:CLASS`` option every command shares (resolved by ``load_impl``,
    which also takes the short names of ``tqbatch.testing.target.ALIASES``)."""
    from tqbatch.testing.target import ALIASES

    parser.add_argument(
        "--impl",
        metavar="MODULE:CLASS",
        default=None,
        help=f"{help}: module:Class or one of {', '.join(ALIASES)} (default: {default})",
    )


def add_backend_arguments(parser) -> None:
    """``--precision`` and ``--device``, which every command takes (see tqbatch.testing.backend)."""
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="float32 matmul precision: float32 (default: MLX_ENABLE_TF32=0) or tf32, "
        "as CUDA and Apple M5 GPUs serve (default: $TQBATCH_PRECISION)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="MLX default device (default: $TQBATCH_DEVICE, else MLX's own default)",
    )
