"""``tqbatch servers``: the HTTP server oracle over servers, caches and scenarios, as a table.

Each server (mlx-vlm's, mlx-lm's) is started with each cache (tqbatch's class,
mlx-vlm's own class, ``BatchKVCache`` with no quantization) on a tiny local
model (``tqbatch.workbench.local_model``), and each scenario's requests are
sent together, then alone (``tqbatch.workbench.http_oracle``). One row per
request: PASS, FAIL (first differing token) or ERROR (HTTP error), which cache
classes served it, and why a difference is the server's where it is
(``tqbatch.workbench.server_report``).

Exit codes (``tqbatch.exitcodes``): 0 every request on tqbatch's class (or
``--impl``) equals its alone run or differs for a reason of the server's; 1
one does not, or a scenario's requests never shared a batch; 2 a usage error.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tqbatch.exitcodes import ExitCode

SERVERS = ("mlx-vlm", "mlx-lm")
CACHES = ("tqbatch", "mlx-vlm", "BatchKVCache")


def register(subparsers) -> None:
    from tqbatch.workbench.http_oracle import SCENARIOS

    parser = subparsers.add_parser(
        "servers",
        help="real mlx-vlm and mlx-lm HTTP servers: each batched reply against its alone run",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument(
        "--caches",
        nargs="+",
        choices=CACHES,
        default=list(CACHES),
        help="mlx-vlm's class runs on mlx-vlm's server only (default: all)",
    )
    parser.add_argument(
        "--scenarios", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS)
    )
    parser.add_argument(
        "--impl",
        metavar="MODULE:CLASS",
        help="serve a subclass of tqbatch's class in place of tqbatch's (a cache under test)",
    )
    parser.add_argument("--bits", type=float, default=4.0, help="TurboQuant bits (default 4)")
    parser.add_argument(
        "--load",
        nargs=2,
        type=int,
        metavar=("N", "AT_ONCE"),
        help="also a load run per server and cache: N requests, AT_ONCE at a time, each "
        "judged against its alone run, with tokens/s and the server's peak memory",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument(
        "--keep", metavar="DIR", type=Path, help="keep the model directories and server logs here"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqbatch.workbench import server_report
    from tqbatch.workbench.http_oracle import SCENARIOS, run_load, run_scenario
    from tqbatch.workbench.local_model import write_model_dir
    from tqbatch.workbench.server_process import Launch

    with tempfile.TemporaryDirectory(prefix="tqbatch-servers-") as scratch:
        workdir = args.keep or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        results, loads = [], []
        for server in args.servers:
            model_dir = write_model_dir(workdir / f"model-{server}", server=server)
            for cache in args.caches:
                if server == "mlx-lm" and cache == "mlx-vlm":
                    continue
                impl = args.impl if cache == "tqbatch" else None
                launch = Launch(server=server, cache=cache, bits=args.bits, impl=impl)
                for name in args.scenarios:
                    scenario = SCENARIOS[name]
                    if server not in scenario.servers:
                        continue
                    print(f"{launch.label}: {name} ...", file=sys.stderr, flush=True)
                    results.append(run_scenario(launch, scenario, model_dir, workdir))
                if args.load:
                    n, at_once = args.load
                    print(f"{launch.label}: load ...", file=sys.stderr, flush=True)
                    loads.append(
                        run_load(launch, model_dir, workdir, requests=n, concurrency=at_once)
                    )
    print(server_report.render_summary(results, markdown=args.markdown))
    print()
    print(server_report.render(results, markdown=args.markdown))
    problems = server_report.unexplained(results)
    if loads:
        print()
        print(server_report.render_load(loads, markdown=args.markdown))
        problems += server_report.load_problems(loads)
    for line in problems:
        print(f"FAIL {line}")
    if args.keep:
        print(f"models and server logs: {args.keep}")
    return ExitCode.DEFECT if problems else ExitCode.OK
