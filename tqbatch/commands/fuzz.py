"""``tqbatch fuzz``: a bounded property-machine campaign against a target.

Argument parsing and printing around ``tqbatch.testing.search.campaign``: a
progress bar, then a summary (examples, shrink runs, how often each op ran,
op pairs covered, failures). On a failure it prints the shrunk op sequence,
saves it as a scenario (``tqbatch.testing.replay.scenario``) and exits 1.
``--survey`` keeps going after failures and lists every distinct failing
check, each with its own saved scenario; it exits 1 only for failures of the
contract (policy differences are listed, see ``tqbatch.testing.contract.checks``).
``--workers N`` runs N shards through pytest-xdist (``tqbatch.testing.search.shards``),
each shard a distinct seed; every shard's failures are reported.
``--database SPEC`` shares a Hypothesis example database
(``tqbatch.testing.search.databases``) with every other campaign pointed at it: what
is saved there is replayed first, and what is found is saved there.
``--replay-only`` replays it and generates nothing (exit 5 when nothing was
saved: nothing was checked). ``--junit-xml PATH`` writes a JUnit XML report
(``tqbatch.testing.gate.junit``). ``--known-failures FILE`` (implies
``--survey``) judges the failures against a known-failures list
(``tqbatch.testing.gate.known_failures``), as ``tqbatch conformance`` does: only
contract failures that are not listed fail the run, listed ones not found
are reported as no longer failing (and fail it with
``--strict-known-failures``). Configurations the target's constructor cannot
take (split key/value bits, a seed) are not drawn, and are reported as
unsupported.

Exit codes (``tqbatch.exitcodes``): 0 no failure (a survey: no contract
failure; with ``--known-failures``: none that is not listed); 1 a failure;
2 a usage error, a target that does not load or a known-failures file that
does not parse; 3 the
backend failed its check; 4 the harness extra is missing (``--workers``
needs pytest-xdist too); 5 nothing was checked: no example ran and nothing
was replayed, as ``--replay-only`` with nothing saved for the target (a CI
lane decides whether that is acceptable, e.g. before the first nightly has
saved anything) or shards that never ran. Under GitHub Actions the summary
and the failures are also appended to ``$GITHUB_STEP_SUMMARY``.

A ``--database`` URL's password is used to open it and shown nowhere: not in
the output, the job summary, the JUnit XML nor the saved scenarios, where the
URL is written as ``redact_url`` writes it (``redis://:****@HOST:PORT/DB``).
"""

from __future__ import annotations

import sys

from tqbatch.commands import add_impl_argument, md_cell, step_summary
from tqbatch.commands import console as make_console
from tqbatch.commands._gate import add_known_failures_arguments
from tqbatch.exitcodes import ExitCode


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
    add_known_failures_arguments(parser, per_target=False)
    parser.set_defaults(func=run)


# ---------------------------------------------------------------- command


def run(args) -> int:
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tqbatch.commands import _gate
    from tqbatch.testing.gate.known_failures import KnownFailuresError
    from tqbatch.testing.search.databases import (
        DatabaseSpecError,
        check_database,
        open_database,
        redact_text,
        redact_url,
    )
    from tqbatch.testing.search.shards import campaign_from_options, run_shards
    from tqbatch.testing.target import (
        impl_spec,
        load_impl,
        missing_capabilities,
        unsupported_configurations,
    )

    console = make_console(stderr=True)
    impl = load_impl(args.impl)  # a bad target: ImplSpecError, reported by tqbatch.cli
    if args.workers < 1 or (args.examples is not None and args.examples < 1):
        console.print("[red]--workers and --examples must be positive[/red]")
        return ExitCode.USAGE
    if args.minutes is not None and args.minutes <= 0:  # 0 would be read as no time budget
        console.print("[red]--minutes must be positive[/red]")
        return ExitCode.USAGE
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
        # open_database's messages redact the URL already: this catches one that does not.
        why = redact_text(str(exc), args.database) if args.database else exc
        print(f"tqbatch fuzz: {why}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        known = _gate.load_known_failures(args.known_failures)
        known_files = [str(_gate.known_failures_path(f)) for f in args.known_failures]
    except KnownFailuresError as exc:
        print(f"tqbatch fuzz: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if args.known_failures and not args.survey:
        # A plain campaign stops at its first failure, known or not.
        console.print("--known-failures surveys: every distinct failure is judged")
        args.survey = True
    if args.examples is None and args.minutes is None and not args.replay_only:
        args.minutes = 2.0
    if args.replay_only and args.workers > 1:
        # Every shard would replay the same saved examples.
        console.print("--replay-only runs in one process: --workers is ignored")
        args.workers = 1
    if args.workers > 1:
        # The shards run under pytest-xdist in subprocesses, where a missing
        # package would only show as shards that never ran: exit 4 here instead.
        import pytest  # noqa: F401
        import xdist  # noqa: F401
    target = impl_spec(impl)
    missing = missing_capabilities(impl)
    if missing:
        console.print(f"{target} lacks {', '.join(missing)}: those rules are skipped")
    configurations = unsupported_configurations(impl)
    if configurations:
        console.print(
            f"{target}'s constructor cannot take {', '.join(configurations)}: "
            "those configurations are not drawn (unsupported, not a defect)"
        )
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
    # What is shown and saved of the run: the options with no password. The
    # shards get ``options`` itself, as each opens the database again.
    shown_database = redact_url(args.database) if args.database else args.database
    shown = dict(options, database=shown_database)

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
    _print_summary(result, target, args.backend, missing, shown_database, configurations)
    from tqbatch.testing.search.campaign import save_failures

    paths = save_failures(result, args.out, backend=args.backend, options=shown)
    verdict = None
    if args.survey:
        _print_survey(result, paths)
        verdict = _gate.verdict_of(target, impl, result, known, known_files, paths)
        for line in verdict.report_lines(args.strict_known_failures):
            console.print(escape(line.strip()))
    elif result.failure:
        from tqbatch.testing.world import format_ops

        console.print(f"[red]FAILED[/red]: {escape(result.failure.message)}")
        console.print("shrunk op sequence:\n" + format_ops(result.failure.ops or []))
    for path in paths:
        if path is not None:
            console.print(f"saved as a scenario: {path}  (reproduce: tqbatch replay {path})")
    nothing_checked = not (result.examples or result.replayed or result.failures)
    if args.junit_xml:
        from tqbatch.testing.gate.junit import write_junit

        write_junit(
            result,
            args.junit_xml,
            target=target,
            paths=paths,
            options=shown,
            nothing_checked=nothing_checked,
        )
        console.print(f"JUnit XML report: {args.junit_xml}")
    if nothing_checked:
        if args.replay_only:
            console.print(
                f"nothing was checked: {shown_database} holds no saved example of {target} "
                "(with these switches)"
            )
        else:
            console.print("nothing was checked: no example ran")
        code = ExitCode.NOTHING_CHECKED
    elif verdict is not None:  # a survey: contract failures not known fail it
        code = ExitCode.OK if verdict.passes(args.strict_known_failures) else ExitCode.DEFECT
    else:
        code = ExitCode.DEFECT if result.failures else ExitCode.OK
    step_summary(_markdown(result, target, args.backend, paths, shown_database, code, verdict))
    return code


def _print_summary(result, target, backend, missing, database=None, configurations=()) -> None:
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
        found = sum(1 for f in result.failures if f.replayed)
        table.add_row("  found while replaying", str(found))
    table.add_row("skipped (unsupported)", ", ".join(missing) or "-")
    table.add_row("configurations not drawn (unsupported)", ", ".join(configurations) or "-")
    make_console().print(table)


def _print_survey(result, paths) -> None:
    from rich.markup import escape
    from rich.table import Table

    if not result.failures:
        make_console().print(f"no failures in {result.examples} examples")
        return

    table = Table(title="distinct failures (check@op: what failed, and where)")
    for column in ("identity", "level", "ops", "what failed", "scenario"):
        table.add_column(column)
    for failure, path in zip(result.failures, paths):
        table.add_row(
            escape(failure.identity or "(harness)"),
            failure.level,
            str(len(failure.ops or ())),
            escape(failure.summary[:160]),
            escape(str(path or "-")),
        )
    make_console().print(table)
    if result.exhausted:
        make_console().print("every example ended in a failure already listed: the search stopped")


def _markdown(result, target, backend, paths, database, code, verdict=None) -> str:
    """The run as markdown, for GitHub Actions' job summary."""
    from tqbatch.testing.backend import describe_line

    lines = [
        "### tqbatch fuzz",
        "",
        f"exit {int(code)}: {code.meaning}",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| target | `{md_cell(target)}` |",
        f"| backend | {md_cell(describe_line(backend))} |",
        f"| examples | {result.examples} |",
    ]
    if database:
        lines.append(f"| replayed from {md_cell(database)} | {result.replayed} |")
    lines += [
        f"| shrink runs | {result.shrink_runs} |",
        f"| ops | {sum(result.op_counts.values())} |",
        f"| seconds | {result.seconds:.0f} |",
        f"| failures | {len(result.failures)} |",
    ]
    if verdict is not None and verdict.known_failures:
        j = verdict.triage
        lines += [
            f"| known failures found | {len(j.known)} |",
            f"| not known (fail the run) | {md_cell(', '.join(verdict.failing))} |",
            f"| listed, no longer fail | {md_cell(', '.join(j.fixed))} |",
        ]
    if result.failures:
        lines += [
            "",
            "| identity | level | ops | what failed | scenario |",
            "|---|---|---|---|---|",
        ]
        for failure, path in zip(result.failures, paths):
            lines.append(
                f"| `{md_cell(failure.identity or '(harness)')}` | {failure.level} "
                f"| {len(failure.ops or ())} | {md_cell(failure.summary[:160])} "
                f"| {f'`{md_cell(path)}`' if path else '-'} |"
            )
    return "\n".join(lines)
