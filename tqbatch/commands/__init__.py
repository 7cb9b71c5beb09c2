"""Sub-commands of the ``tqbatch`` CLI, one module each.

Every public module here defines ``register(subparsers)`` (adds its
sub-parser and ``set_defaults(func=run)``) and ``run(args) -> int`` (the exit
code). :mod:`tqbatch.cli` discovers them with :mod:`pkgutil`; modules whose
names start with ``_`` are helpers, not commands.
"""


def add_impl_argument(parser, help: str = "cache under test") -> None:
    """The ``--impl MODULE:CLASS`` option every command shares (resolved by ``load_impl``)."""
    parser.add_argument(
        "--impl",
        metavar="MODULE:CLASS",
        default=None,
        help=f"{help} (default: $TQBATCH_IMPL or tqbatch.BatchTurboQuantKVCache)",
    )
