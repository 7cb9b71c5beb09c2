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
``--database SPEC`` shares a Hypothesis example database
(``tqbatch.testing.databases``) with every other campaign pointed at it: what
is saved there is replayed first, and what is found is saved there.
``--replay-only`` replays it and generates nothing (exit 5 when nothing was
saved: nothing was checked). ``--junit-xml PATH`` writes a JUnit XML report
(``tqbatch.testing.junit``).
"""

from __future__ import annotations

import sys

from tqbatch.commands import add_impl_argument

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# --replay-only with nothing saved for the target: no example ran, so there is
# no verdict (5, as pytest's "no tests collected"). A CI lane decides whether
# that is acceptable, e.g. before the first nightly has saved anything.
EXIT_NOTHING_CHECKED = 5


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
    budget.add_argument(
        "--replay-only",
        action="store_true",
        help="replay the examples saved in --database and generate nothing "
        "(exit 5 if none is saved: nothing was checked)",
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
        "--database",
        metavar="SPEC",
        help="Hypothesis example database shared with other campaigns: a directory, "
        "redis://HOST:PORT/DB, or github:OWNER/REPO[/ARTIFACT] (a workflow's artifact, "
        "read-only, with a local directory). Saved failures are replayed first",
    )
    parser.add_argument(
        "--database-local",
        metavar="DIR",
        help="with --database github:...: the local directory that keeps what this run "
        "finds (default: .hypothesis/examples)",
    )
    parser.add_argument(
        "--junit-xml", metavar="PATH", help="also write a JUnit XML report of the campaign"
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

    from tqbatch.testing.databases import DatabaseSpecError, check_database, open_database
    from tqbatch.testing.impl import impl_spec, load_impl, missing_capabilities
    from tqbatch.testing.shards import campaign_from_options, run_shards

    console = Console(stderr=True)
    impl = load_impl(args.impl)  # a bad target: ImplSpecError, reported by tqbatch.cli
    if args.workers < 1 or (args.examples is not None and args.examples < 1):
        console.print("[red]--workers and --examples must be positive[/red]")
        return EXIT_USAGE
    database = None
    try:
        if args.replay_only and not args.database:
            raise DatabaseSpecError("--replay-only needs --database (what to replay)")
        if args.database_local and not (args.database or "").startswith("github:"):
            raise DatabaseSpecError("--database-local goes with --database github:OWNER/REPO")
        if args.database:
            database = open_database(args.database, local=args.database_local)
            check_database(database, args.database)
    except DatabaseSpecError as exc:  # one line, as tqbatch.cli reports a bad --impl
        print(f"tqbatch fuzz: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.examples is None and args.minutes is None and not args.replay_only:
        args.minutes = 2.0
    if args.replay_only and args.workers > 1:
        # Every shard would replay the same saved examples.
        console.print("--replay-only runs in one process: --workers is ignored")
        args.workers = 1
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
        "database": args.database,
        "database_local": args.database_local,
        "replay_only": args.replay_only,
    }

    verb = "replaying" if args.replay_only else "surveying" if args.survey else "fuzzing"
    with Progress(
        TextColumn(verb + " {task.fields[impl]}"),
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
                database=database,
            )
    _print_summary(result, target, args.backend, missing, args.database)
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
    nothing_checked = args.replay_only and not result.replayed and not result.failures
    if args.junit_xml:
        from tqbatch.testing.junit import write_junit

        write_junit(
            result,
            args.junit_xml,
            target=target,
            paths=paths,
            options=options,
            nothing_checked=nothing_checked,
        )
        console.print(f"JUnit XML report: {args.junit_xml}")
    if nothing_checked:
        console.print(
            f"nothing was checked: {args.database} holds no saved example of {target} "
            "(with these switches)"
        )
        return EXIT_NOTHING_CHECKED
    if args.survey:
        from tqbatch.testing.campaign import conforms

        return EXIT_OK if conforms(result) else EXIT_FAILED
    return EXIT_FAILED if result.failures else EXIT_OK


def _print_summary(result, target, backend, missing, database=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from tqbatch.testing.backend import describe_line

    table = Table(title="tqbatch fuzz summary")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("target", target)
    table.add_row("backend", describe_line(backend))
    table.add_row("examples", str(result.examples))
    if database:
        table.add_row("database", database)
        table.add_row("replayed from the database", str(result.replayed))
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
            f"{shard['examples']} examples, "
            + (f"{shard.get('replayed', 0)} replayed, " if database else "")
            + f"{shard['failures']} failures",
        )
    table.add_row("failures", str(len(result.failures)))
    if database:
        found = sum(1 for f in result.failures if f.get("replayed"))
        table.add_row("  found while replaying", str(found))
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
