"""Sub-commands of the ``tqbatch`` CLI, one module each.

Every public module here defines ``register(subparsers)`` (adds its
sub-parser and ``set_defaults(func=run)``) and ``run(args) -> int`` (the exit
code). :mod:`tqbatch.cli` discovers them with :mod:`pkgutil`; modules whose
names start with ``_`` are helpers, not commands.
"""

from tqbatch.testing.backend import DEVICES, PRECISIONS


def add_impl_argument(parser, help: str = "cache under test") -> None:
    """The ``--impl MODULE:CLASS`` option every command shares (resolved by ``load_impl``)."""
    parser.add_argument(
        "--impl",
        metavar="MODULE:CLASS",
        default=None,
        help=f"{help} (default: $TQBATCH_IMPL or tqbatch.BatchTurboQuantKVCache)",
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
