"""``tqbatch models``: the model-family matrix (tqbatch.workbench.model_matrix) for a target cache.

Prints one row per family and scenario and one column per target: PASS, FAIL
with the failed check or the logit gap, ERROR with the exception, N/A with
why. The exit code is the drop-in verdict: 1 if the target fails or raises in
a cell where mlx-lm's ``BatchKVCache`` passes, else 0.

Exit codes (``tqbatch.exitcodes``): 0 no such cell; 1 at least one; 2 a
usage error or a target that does not load; 3 the backend failed its check;
4 the harness extra (rich) is missing; 5 nothing was checked: every cell of
the target is N/A or NONDET (no verdict). Under GitHub Actions the matrix is
also appended to ``$GITHUB_STEP_SUMMARY`` as a markdown table.
"""

from __future__ import annotations

import argparse

from tqbatch.commands import add_impl_argument, step_summary
from tqbatch.commands import console as make_console
from tqbatch.exitcodes import ExitCode

# Statuses that give no verdict on the target: a run where every cell of the
# target has one of these checked nothing.
NO_VERDICT = ("N/A", "NONDET")
# Characters of a markdown cell: enough for a failure's layer and cache class.
WIDTH = 130
# --families names that stand for every family of one library.
GROUPS = ("mlx-vlm", "mlx-lm")


def register(subparsers) -> None:
    from tqbatch.workbench import lm_families, model_matrix, vlm_families

    parser = subparsers.add_parser(
        "models",
        help="the cache as a drop-in inside mlx-vlm and mlx-lm model families, against "
        "BatchKVCache",
        description=__doc__.split("\n\n")[1],
    )
    add_impl_argument(parser, "batch cache under test")
    parser.add_argument(
        "--families",
        nargs="+",
        choices=model_matrix.ALL_FAMILIES + tuple(GROUPS),
        default=["mlx-vlm"],
        metavar="FAMILY",
        help=f"families to run: mlx-vlm's {', '.join(vlm_families.FAMILIES)} (all of them: "
        f"mlx-vlm, the default); mlx-lm's own model classes {', '.join(lm_families.FAMILIES)} "
        "(all of them: mlx-lm)",
    )
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=model_matrix.ALL_SCENARIOS,
        default=list(model_matrix.ALL_SCENARIOS),
        metavar="SCENARIO",
        help=f"scenarios to run (default: all of {', '.join(model_matrix.ALL_SCENARIOS)}; "
        "batch_generator, mlx-lm's BatchGenerator, exists for the mlx-lm: families only)",
    )
    parser.add_argument(
        "--compare",
        nargs="*",
        default=[model_matrix.BASELINE],
        metavar="TARGET",
        help="further columns: BatchKVCache (full precision, the default), mlx-vlm "
        "(its BatchTurboQuantKVCache) or MODULE:CLASS",
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the matrix as a markdown table"
    )
    parser.add_argument(
        "--grid",
        action="store_true",
        help="print the statuses as a markdown grid: a row per family, a column per scenario, "
        "each cell the targets' statuses (details: --markdown)",
    )
    parser.set_defaults(func=run)


def _families(names) -> list[str]:
    """``names`` with the groups ``mlx-vlm`` and ``mlx-lm`` expanded, each family once."""
    from tqbatch.workbench import lm_families, vlm_families

    groups = {"mlx-vlm": vlm_families.FAMILIES, "mlx-lm": lm_families.FAMILIES}
    expanded = [f for name in names for f in groups.get(name, (name,))]
    return list(dict.fromkeys(expanded))


def _targets(args):
    from tqbatch.testing.target import impl_spec, load_impl
    from tqbatch.workbench import model_matrix

    impl = load_impl(args.impl)
    if args.impl is None and impl.__module__.startswith("tqbatch.cache"):
        main = model_matrix.target_for("tqbatch")
    else:
        main = model_matrix.Target(impl_spec(impl), impl)
    names = [model_matrix.BASELINE] if model_matrix.BASELINE not in args.compare else []
    return [main] + [model_matrix.target_for(n) for n in args.compare + names]


def markdown(cells, targets) -> str:
    """The matrix as a markdown table: family, scenario, one column per target."""
    by_key = {(c.family, c.scenario, c.target): c for c in cells}
    rows = dict.fromkeys((c.family, c.scenario) for c in cells)  # in run order
    lines = [
        "| family | scenario | " + " | ".join(t.name for t in targets) + " |",
        "|---|---|" + "---|" * len(targets),
    ]
    for family, scenario in rows:
        briefs = [by_key[family, scenario, t.name].brief(WIDTH) for t in targets]
        lines.append(
            f"| {family} | {scenario} | " + " | ".join(b.replace("|", "/") for b in briefs) + " |"
        )
    return "\n".join(lines)


def grid(cells, targets) -> str:
    """The statuses as a markdown grid: a row per family, a column per scenario.

    A cell holds each target's status in the targets' order ("PASS / PASS"),
    blank where the scenario does not exist for the family; details are in
    ``markdown``.
    """
    by_key = {(c.family, c.scenario, c.target): c.status for c in cells}
    families = list(dict.fromkeys(c.family for c in cells))
    scenarios = list(dict.fromkeys(c.scenario for c in cells))
    lines = [
        "| family | " + " | ".join(scenarios) + " |",
        "|---|" + "---|" * len(scenarios),
    ]
    for family in families:
        row = [
            " / ".join(by_key[family, s, t.name] for t in targets)
            if (family, s, targets[0].name) in by_key
            else ""
            for s in scenarios
        ]
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from tqbatch.testing.backend import describe_line
    from tqbatch.workbench import model_matrix

    console = make_console(stderr=True)
    args.families = _families(args.families)
    targets = _targets(args)  # a bad target: ImplSpecError, reported by tqbatch.cli
    total = len(targets) * sum(
        len(set(args.scenarios) & set(model_matrix.scenarios_for(f))) for f in args.families
    )
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("model matrix", total=total)

        def advance(cell):
            progress.update(task, advance=1, description=f"{cell.family} {cell.scenario}")

        cells = model_matrix.run_matrix(targets, args.families, args.scenarios, progress=advance)

    if args.grid:
        print(f"statuses: {' / '.join(t.name for t in targets)}\n")
        print(grid(cells, targets))
    if args.markdown:
        print(markdown(cells, targets))
    elif not args.grid:
        table = Table(title=f"model-family matrix ({describe_line(args.backend)})")
        table.add_column("family")
        table.add_column("scenario")
        for target in targets:
            table.add_column(target.name, overflow="fold")
        by_key = {(c.family, c.scenario, c.target): c for c in cells}
        for family in args.families:
            for scenario in [s for s in args.scenarios if s in model_matrix.scenarios_for(family)]:
                cells_here = [by_key[family, scenario, t.name] for t in targets]
                table.add_row(family, scenario, *(c.brief(40) for c in cells_here))
        make_console().print(table)
        checks = sum(c.checks for c in cells)
        admitted = sum(c.admitted for c in cells)
        print(f"oracle checks: {checks}; rounding choices admitted: {admitted}")
        for cell in cells:
            if cell.status in ("FAIL", "ERROR", "NONDET"):
                print(f"{cell.target} / {cell.family} / {cell.scenario}: {cell.short()}")

    failed = model_matrix.regressions(cells, targets[0].name)
    for cell in failed:
        console.print(
            f"[red]{cell.target} {cell.status}[/red] in {cell.family} / {cell.scenario}, "
            f"where {model_matrix.BASELINE} passes: {cell.detail}"
        )
    if failed:
        code = ExitCode.DEFECT
    elif all(c.status in NO_VERDICT for c in cells if c.target == targets[0].name):
        console.print(f"nothing was checked: every cell of {targets[0].name} is N/A or NONDET")
        code = ExitCode.NOTHING_CHECKED
    else:
        code = ExitCode.OK
    step_summary(
        f"### tqbatch models\n\nexit {int(code)}: {code.meaning}; "
        f"{describe_line(args.backend)}\n\n{markdown(cells, targets)}"
    )
    return code
