"""``tqbatch fuzz``: a bounded property-machine campaign against a target.

Argument parsing and printing around ``tqbatch.testing.campaign``: a
progress bar, then a summary (examples, shrink runs, how often each op ran,
op pairs covered, failures). On a failure it prints the shrunk op sequence,
saves it as a scenario (``tqbatch.testing.scenario``) and exits 1.
``--survey`` keeps going after failures and lists every distinct failing
check, each with its own saved scenario; it exits 1 only for failures of the
contract (policy differences are listed, see ``tqbatch.testing.checks``).
``--workers N`` runs N shards through pytest-xdist (``tqbatch.testing.shards``),
each shard a distinct seed; every shard's failures are reported.
"""

from __future__ import annotations

from tqbatch.commands import add_impl_argument

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "fuzz",
        help="run a bounded state-machine campaign against a cache; exit 1 on failure",
        description=(
            "Drive the cache through random op sequences checked against the oracles. "
            "On failure, print the shrunk op sequence, save it as a scenario and exit 1. "
            "With --survey, keep going and list every distinct failing check."
        ),
    )
    add_impl_argument(parser)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="time budget (default: 2 minutes)")
    budget.add_argument(
        "--examples",
        type=int,
        help="number of examples (machine runs) to generate; shrinking a failure runs more",
    )
    parser.add_argument(
        "--profile",
        default="nightly",
        help="Hypothesis profile for steps per example (default: nightly)",
    )
    parser.add_argument("--workers", type=int, default=1, help="processes (pytest-xdist)")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    parser.add_argument(
        "--out",
        default="fuzz-failures",
        help="directory for the failing scenarios (default: ./fuzz-failures)",
    )
    parser.add_argument(
        "--survey",
        action="store_true",
        help="keep going after failures: every distinct failing check, each with its repro",
    )
    parser.add_argument(
        "--no-contract-checks",
        action="store_true",
        help="skip structural contract checks (e.g. no `_idx` attribute) to reach deeper bugs",
    )
    parser.set_defaults(func=run)


# ---------------------------------------------------------------- command


def run(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tqbatch.testing.impl import impl_spec, load_impl, missing_capabilities
    from tqbatch.testing.shards import campaign_from_options, run_shards

    console = Console(stderr=True)
    impl = load_impl(args.impl)  # a bad target: ImplSpecError, reported by tqbatch.cli
    if args.workers < 1 or (args.examples is not None and args.examples < 1):
        console.print("[red]--workers and --examples must be positive[/red]")
        return EXIT_USAGE
    if args.examples is None and args.minutes is None:
        args.minutes = 2.0
    target = impl_spec(impl)
    missing = missing_capabilities(impl)
    if missing:
        console.print(f"{target} lacks {', '.join(missing)}: those rules are skipped")
    # Every option of the run, saved with each failure so that it can be rerun.
    options = {
        "impl": target,
        "examples": args.examples,
        "minutes": args.minutes,
        "profile": args.profile,
        "seed": args.seed,
        "workers": args.workers,
        "survey": args.survey,
        "contract_checks": not args.no_contract_checks,
    }

    with Progress(
        TextColumn(("surveying" if args.survey else "fuzzing") + " {task.fields[impl]}"),
        BarColumn(),
        TextColumn("{task.completed} examples"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("fuzz", total=args.examples, impl=target)
        if args.workers > 1:
            result = run_shards(options, lambda n: progress.update(task, completed=n))
        else:
            result = campaign_from_options(
                impl,
                options,
                args.seed,
                lambda r: progress.update(task, completed=r.examples),
            )
    _print_summary(result, target, args.backend, missing)
    from tqbatch.testing.campaign import save_failures

    paths = save_failures(result, args.out, backend=args.backend, options=options)
    if args.survey:
        _print_survey(result, paths)
    elif result.failure:
        from tqbatch.testing.ops import format_ops

        console.print(f"[red]FAILED[/red]: {escape(result.failure['message'])}")
        console.print("shrunk op sequence:\n" + format_ops(result.failure["ops"]))
    for path in paths:
        if path is not None:
            console.print(f"saved as a scenario: {path}  (reproduce: tqbatch replay {path})")
    if args.survey:
        from tqbatch.testing.campaign import conforms

        return EXIT_OK if conforms(result) else EXIT_FAILED
    return EXIT_FAILED if result.failures else EXIT_OK


def _print_summary(result, target, backend, missing) -> None:
    from rich.console import Console
    from rich.table import Table

    from tqbatch.testing.backend import describe_line

    table = Table(title="tqbatch fuzz summary")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("target", target)
    table.add_row("backend", describe_line(backend))
    table.add_row("examples", str(result.examples))
    table.add_row("shrink runs", str(result.shrink_runs))
    table.add_row("ops", str(sum(result.op_counts.values())))
    table.add_row("seconds", f"{result.seconds:.0f}")
    for name, n in sorted(result.op_counts.items()):
        table.add_row(f"  op {name}", str(n))
    table.add_row("op pairs covered", str(len(result.pair_counts)))
    table.add_row("rounding choices admitted", str(result.rounding_admitted))
    for shard in sorted(result.shards, key=lambda s: s["shard"]):
        table.add_row(
            f"  shard {shard['shard']}",
            f"{shard['examples']} examples, {shard['failures']} failures",
        )
    table.add_row("failures", str(len(result.failures)))
    table.add_row("skipped (unsupported)", ", ".join(missing) or "-")
    Console().print(table)


def _print_survey(result, paths) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if not result.failures:
        Console().print(f"no failures in {result.examples} examples")
        return

    table = Table(title="distinct failures (check@op: what failed, and where)")
    for column in ("identity", "level", "ops", "what failed", "scenario"):
        table.add_column(column)
    for failure, path in zip(result.failures, paths):
        table.add_row(
            escape(failure.get("identity") or "(harness)"),
            failure["level"],
            str(len(failure["ops"])),
            escape((failure.get("what") or failure["message"]).splitlines()[0][:160]),
            escape(str(path or "-")),
        )
    Console().print(table)
    if result.exhausted:
        Console().print("every example ended in a failure already listed: the search stopped")
