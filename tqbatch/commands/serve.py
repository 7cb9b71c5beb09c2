"""``tqbatch serve``: run mlx-vlm's or mlx-lm's HTTP server on tqbatch's batch cache.

``tqbatch serve mlx-vlm -- ARGS`` runs ``mlx_vlm.server`` with ARGS after
``tqbatch.mlx_vlm.enable()``: the server's TurboQuant batches (``--kv-bits B
--kv-quant-scheme turboquant``) are tqbatch's class. ``--cache mlx-vlm``
leaves mlx-vlm's own class in place (the same server and log, for comparison).

``tqbatch serve mlx-lm [--bits B] [--seed S] -- ARGS`` runs ``mlx_lm.server``
with ARGS, every loaded model's ``make_cache`` giving TurboQuant caches of that
configuration (``tqbatch.mlx_lm.install_make_cache``) and mlx-lm's attention
routed to them (``tqbatch.mlx_lm.enable()``). mlx-lm's server then batches the
requests (its own ``--kv-bits`` serves them one at a time).

Each batch cache the server builds and each join of two batches is logged on
stderr, one line each starting ``tqbatch serve:``, naming the class, so that
a client can tell which cache served a request and that requests shared a
batch. Exit codes: the server's own.
"""

from __future__ import annotations

import argparse
import sys

SERVERS = ("mlx-vlm", "mlx-lm")
LOG_PREFIX = "tqbatch serve:"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run mlx-vlm's or mlx-lm's HTTP server on tqbatch's batch cache",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("server", choices=SERVERS, help="whose server to run")
    parser.add_argument(
        "--cache",
        choices=("tqbatch", "mlx-vlm"),
        default="tqbatch",
        help="mlx-vlm's server only: whose TurboQuant batch cache it builds (default tqbatch)",
    )
    parser.add_argument(
        "--bits", type=float, default=4.0, help="mlx-lm's server only: TurboQuant bits (default 4)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="mlx-lm's server only: TurboQuant codec seed"
    )
    parser.add_argument(
        "server_args",
        nargs=argparse.REMAINDER,
        metavar="-- ARGS",
        help="the server's own arguments, after --",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    server_args = list(args.server_args)
    if server_args[:1] == ["--"]:
        server_args = server_args[1:]
    if args.server == "mlx-vlm":
        return _serve_mlx_vlm(server_args, tqbatch_cache=args.cache == "tqbatch")
    if args.cache != "tqbatch":
        print("tqbatch serve: --cache applies to mlx-vlm's server only", file=sys.stderr)
        return 2
    return _serve_mlx_lm(server_args, bits=args.bits, seed=args.seed)


def log(message: str) -> None:
    print(f"{LOG_PREFIX} {message}", file=sys.stderr, flush=True)


def _class_names(caches) -> str:
    names = sorted({f"{type(c).__module__}.{type(c).__qualname__}" for c in caches})
    return ", ".join(names)


def _serve_mlx_vlm(server_args: list[str], *, tqbatch_cache: bool) -> int:
    from mlx_vlm.generate import ar

    import tqbatch.mlx_vlm

    if tqbatch_cache:
        tqbatch.mlx_vlm.enable()
    make_cache, extend_cache = ar._make_cache, ar._extend_cache

    def logged_make_cache(model, left_padding, *a, **kw):
        caches = make_cache(model, left_padding, *a, **kw)
        log(f"batch of {len(left_padding)} rows on {_class_names(caches)}")
        return caches

    def logged_extend_cache(cache_a, cache_b):
        joined = extend_cache(cache_a, cache_b)
        if cache_a and cache_b:
            log(
                f"join: {_class_names(cache_a)} + {_class_names(cache_b)} -> {_class_names(joined)}"
            )
        return joined

    ar._make_cache, ar._extend_cache = logged_make_cache, logged_extend_cache
    from mlx_vlm.server.cli import main

    sys.argv = ["mlx_vlm.server", *server_args]
    owner = "tqbatch" if tqbatch_cache else "mlx-vlm"
    log(f"mlx-vlm's server, TurboQuant batches on {owner}'s class")
    return _exit_code(main)


def _serve_mlx_lm(server_args: list[str], *, bits: float, seed: int) -> int:
    from mlx_lm import server

    import tqbatch.mlx_lm

    load = server.load

    def load_with_tqbatch_caches(*a, **kw):
        loaded = load(*a, **kw)
        model = loaded[0]
        tqbatch.mlx_lm.install_make_cache(model, bits=bits, seed=seed)
        log(f"{type(model).__module__} caches: {_class_names(model.make_cache())}")
        return loaded

    server.load = load_with_tqbatch_caches
    tqbatch.mlx_lm.enable()
    sys.argv = ["mlx_lm.server", *server_args]
    log(f"mlx-lm's server, TurboQuant caches {bits:g} bits seed {seed} (tqbatch)")
    return _exit_code(server.main)


def _exit_code(main) -> int:
    try:
        main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
