"""``tqbatch serve``: run mlx-vlm's or mlx-lm's HTTP server on tqbatch's batch cache.

``tqbatch serve mlx-vlm -- ARGS`` runs ``mlx_vlm.server`` with ARGS after
``tqbatch.mlx_vlm.enable()``: the server's TurboQuant batches (``--kv-bits B
--kv-quant-scheme turboquant``) are tqbatch's class. ``--cache mlx-vlm``
leaves mlx-vlm's own class in place (the same server and log, for comparison).

``tqbatch serve mlx-lm [--bits B] [--seed S] -- ARGS`` runs ``mlx_lm.server``
with ARGS, every loaded model's ``make_cache`` giving TurboQuant caches of that
configuration (``tqbatch.mlx_lm.install_make_cache``) and mlx-lm's attention
routed to them (``tqbatch.mlx_lm.enable()``). mlx-lm's server then batches the
requests (its own ``--kv-bits`` serves them one at a time). ``--cache none``
runs mlx-lm's server as it is, with the same log.

Each batch cache the server builds and each join of two batches is logged on
stderr, one line each starting ``tqbatch serve:``, naming the class, so that
a client can tell which cache served a request and that requests shared a
batch (at the server's INFO log level, its default); mlx-lm's server logs no
line per request, so there each batch's line names its rows' prompt lengths.
Exit codes: the server's own; 2 for a usage error (``--impl`` not a subclass
of tqbatch's class).
mlx-vlm's automatic prefix cache (``APC_ENABLED=1``) restores prefixes into
tqbatch's class too (see ``tqbatch.mlx_vlm``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import threading

from tqbatch.exitcodes import ExitCode

SERVERS = ("mlx-vlm", "mlx-lm")
CACHES = ("tqbatch", "mlx-vlm", "none")
LOG_PREFIX = "tqbatch serve:"
_LOGGER = logging.getLogger("tqbatch.serve")


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache",
        choices=CACHES,
        default="tqbatch",
        help="tqbatch (default): TurboQuant batches on tqbatch's class; mlx-vlm: mlx-vlm's "
        "server on its own class; none: mlx-lm's server as it is (each still logged)",
    )
    parser.add_argument(
        "--bits", type=float, default=4.0, help="mlx-lm's server only: TurboQuant bits (default 4)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="mlx-lm's server only: TurboQuant codec seed"
    )
    parser.add_argument(
        "--impl",
        metavar="MODULE:CLASS",
        help="with --cache tqbatch: a subclass of tqbatch's class to serve on instead "
        "(a cache under test, a mutant of tqbatch.testing.mutants)",
    )


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run mlx-vlm's or mlx-lm's HTTP server on tqbatch's batch cache",
        description=__doc__.split("\n\n")[1],
    )
    _add_options(parser)
    parser.add_argument("server", choices=SERVERS, help="whose server to run")
    parser.add_argument(
        "server_args",
        nargs=argparse.REMAINDER,
        metavar="[OPTIONS] -- ARGS",
        help="this command's options may also follow the server's name; the server's own "
        "arguments come after --",
    )
    parser.set_defaults(func=run)


def _split(args: argparse.Namespace) -> list[str]:
    """The server's arguments; options of this command given after the server's name are parsed
    into ``args`` (argparse hands everything after the positional to the remainder)."""
    rest = list(args.server_args)
    if "--" not in rest:
        return rest
    cut = rest.index("--")
    if rest[:cut]:
        options = argparse.ArgumentParser(prog=f"tqbatch serve {args.server}")
        _add_options(options)
        options.parse_args(rest[:cut], namespace=args)
    return rest[cut + 1 :]


def run(args: argparse.Namespace) -> int:
    server_args = _split(args)
    batch_class = None
    if args.cache == "tqbatch":
        from tqbatch import BatchTurboQuantKVCache
        from tqbatch.testing.target import load_impl

        batch_class = load_impl(args.impl) if args.impl else BatchTurboQuantKVCache
        if not issubclass(batch_class, BatchTurboQuantKVCache):
            print(f"{LOG_PREFIX} --impl must name a subclass of tqbatch's class", file=sys.stderr)
            return ExitCode.USAGE
    elif args.impl:
        print(f"{LOG_PREFIX} --impl needs --cache tqbatch", file=sys.stderr)
        return ExitCode.USAGE
    if args.server == "mlx-vlm":
        return _serve_mlx_vlm(server_args, batch_class=batch_class)
    if args.cache == "mlx-vlm":
        print(f"{LOG_PREFIX} mlx-lm's server has no mlx-vlm cache to keep", file=sys.stderr)
        return ExitCode.USAGE
    return _serve_mlx_lm(server_args, bits=args.bits, seed=args.seed, batch_class=batch_class)


def log(message: str) -> None:
    """One line of this command's log, through ``logging`` once the server has configured it.

    The server's own records go through the root logger's handler, whose lock
    keeps lines from different threads whole; a ``print`` beside them could
    land in the middle of one. Before the server configures logging (a line
    about the setup), the line is printed.
    """
    if logging.getLogger().handlers:
        _LOGGER.info("%s %s", LOG_PREFIX, message)
    else:
        print(f"{LOG_PREFIX} {message}", file=sys.stderr, flush=True)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_names(caches) -> str:
    return ", ".join(sorted({_qualified(type(c)) for c in caches}))


def _log_joins(module) -> None:
    """Log each join of two batches by ``module._extend_cache`` (mlx-vlm's and mlx-lm's name)."""
    extend_cache = module._extend_cache

    def logged(cache_a, cache_b):
        a, b = _class_names(cache_a or ()), _class_names(cache_b or ())
        try:
            joined = extend_cache(cache_a, cache_b)
        except Exception as exc:
            log(f"join failed: {a} + {b}: {type(exc).__name__}: {exc}")
            raise
        if cache_a and cache_b:
            log(f"join: {a} + {b} -> {_class_names(joined)}")
        return joined

    module._extend_cache = logged


def _log_prefix_restores() -> None:
    """Log each batch mlx-vlm's prefix cache builds (its block and checkpoint strategies).

    Both are called through ``mlx_vlm.apc``'s module attributes at call time.
    """
    from mlx_vlm import apc

    def logged(build):
        def restore(rows, *a, **kw):  # rows: one pick (or one row's caches) per request
            caches, longest = build(rows, *a, **kw)
            if caches:
                log(
                    f"batch of {len(rows)} rows restored from the prefix cache on "
                    f"{_class_names(caches)}"
                )
            return caches, longest

        return restore

    apc.make_warm_batch_kv_cache_multi = logged(apc.make_warm_batch_kv_cache_multi)
    apc.make_warm_batch_exact_cache_multi = logged(apc.make_warm_batch_exact_cache_multi)


def _serve_mlx_vlm(server_args: list[str], *, batch_class: type | None) -> int:
    from mlx_vlm.generate import ar

    import tqbatch.mlx_vlm

    if batch_class is not None:
        tqbatch.mlx_vlm.enable(batch_class)
    make_cache = ar._make_cache

    def logged_make_cache(model, left_padding, *a, **kw):
        caches = make_cache(model, left_padding, *a, **kw)
        log(f"batch of {len(left_padding)} rows on {_class_names(caches)}")
        return caches

    ar._make_cache = logged_make_cache
    _log_joins(ar)
    _log_prefix_restores()
    from mlx_vlm.server.cli import main

    owner = _qualified(batch_class) if batch_class else "mlx-vlm's own class"
    log(f"mlx-vlm's server, TurboQuant batches on {owner}")
    sys.argv = ["mlx_vlm.server", *server_args]
    return _exit_code(main)


def _cached(caches: list) -> int:
    """Tokens a request's caches hold before its prompt is processed (its first layer's)."""
    return int(getattr(caches[0], "offset", 0) or 0) if caches else 0


def _serve_mlx_lm(
    server_args: list[str], *, bits: float, seed: int, batch_class: type | None
) -> int:
    from mlx_lm import server
    from mlx_lm.models.cache import make_prompt_cache

    import tqbatch.mlx_lm

    # The module: ``mlx_lm.generate`` as an attribute is the package's function of that name.
    generate = importlib.import_module("mlx_lm.generate")

    load, prompt_cache = server.load, server.make_prompt_cache
    make_batch = generate.BatchGenerator._make_batch

    def load_and_log(*a, **kw):
        loaded = load(*a, **kw)
        model = loaded[0]
        if batch_class is not None:
            tqbatch.mlx_lm.install_make_cache(model, bits=bits, seed=seed, batch_class=batch_class)
        log(f"each request's caches: {_class_names(make_prompt_cache(model))}")
        return loaded

    def logged_make_batch(generator, n, *a, **kw):
        # Each row's whole prompt: what its cache holds already (mlx-lm's prompt cache)
        # and the segments left to process; read before the batch merges the caches.
        rows = list(generator._unprocessed_sequences)[:n]
        prompts = [_cached(row[3]) + sum(len(segment) for segment in row[1]) for row in rows]
        batch = make_batch(generator, n, *a, **kw)
        if rows:
            log(
                f"batch of {len(rows)} rows on {_class_names(batch.prompt_cache)}, "
                f"prompts of {', '.join(map(str, prompts))} tokens"
            )
        return batch

    loading = threading.local()
    provider_load = server.ModelProvider._load

    def provider_load_quietly(self, *a, **kw):
        # Loading calls make_prompt_cache once to decide whether the model can be
        # batched: no request is served there.
        loading.active = True
        try:
            return provider_load(self, *a, **kw)
        finally:
            loading.active = False

    def logged_prompt_cache(model, *a, **kw):
        # The server's path for one request at a time (a draft model, or its own --kv-bits).
        caches = prompt_cache(model, *a, **kw)
        if not getattr(loading, "active", False):
            log(f"one request on {_class_names(caches)}")
        return caches

    server.load = load_and_log
    server.ModelProvider._load = provider_load_quietly
    server.make_prompt_cache = logged_prompt_cache
    generate.BatchGenerator._make_batch = logged_make_batch
    _log_joins(generate)
    if batch_class is not None:
        tqbatch.mlx_lm.enable()
        log(
            f"mlx-lm's server, TurboQuant caches of {bits:g} bits, seed {seed}, "
            f"batched on {_qualified(batch_class)}"
        )
    else:
        log("mlx-lm's server, its own caches")
    sys.argv = ["mlx_lm.server", *server_args]
    return _exit_code(server.main)


def _exit_code(main) -> int:
    try:
        main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
