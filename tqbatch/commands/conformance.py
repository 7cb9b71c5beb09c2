"""``tqbatch conformance``: survey several caches and tabulate their distinct failures.

Each target gets a survey (``tqbatch.testing.campaign``, ``--survey`` of
``tqbatch fuzz``) with the same budget and seed, under the derandomization
of a fixed seed: the table is the same on every run. By default the targets
are mlx-vlm's ``BatchTurboQuantKVCache``, tqbatch's cache and the mutants
that reintroduce the omlx seed's defects (the package cannot ship omlx's
code). ``--markdown`` prints the README's conformance table.

Exit codes (``tqbatch.exitcodes``): the verdict is tqbatch's own cache's
(when it is among the targets): 1 if it does not conform or has policy
differences, else 0, whatever the other targets do; 2 a usage error or a
target that does not load; 3 the backend failed its check; 4 the harness
extra is missing; 5 nothing was checked: no target ran an example. Under
GitHub Actions the markdown table is also appended to ``$GITHUB_STEP_SUMMARY``.
"""

from __future__ import annotations

import sys

from tqbatch.commands import step_summary
from tqbatch.exitcodes import ExitCode

# Short names for the targets the README compares.
ALIASES = {
    "tqbatch": "tqbatch.cache:BatchTurboQuantKVCache",
    "mlx-vlm": "mlx_vlm.turboquant:BatchTurboQuantKVCache",
}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "conformance",
        help="survey caches and tabulate every distinct failure (the README's table)",
        description=(
            "Survey each target (as `tqbatch fuzz --survey`) with one budget and seed and "
            "list its distinct failures by level. Exit 1 if tqbatch's own cache fails."
        ),
    )
    parser.add_argument(
        "targets",
        nargs="*",
        metavar="TARGET",
        help="module:Class, 'tqbatch' or 'mlx-vlm' (default: mlx-vlm, tqbatch, the seed's "
        "defects as mutants)",
    )
    parser.add_argument("--examples", type=int, default=60, help="examples per target")
    parser.add_argument("--seed", type=int, default=0, help="survey seed (default 0)")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default: ci)")
    parser.add_argument("--out", default=None, help="also save each failure as a scenario here")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.set_defaults(func=run)


def _default_targets() -> list[str]:
    from tqbatch.testing.mutants import SEED_DEFECTS, import_path

    return ["mlx-vlm", "tqbatch", *(import_path(name) for name in SEED_DEFECTS)]


def run(args) -> int:
    from tqbatch.testing.campaign import conforms, run_campaign
    from tqbatch.testing.impl import load_impl

    if args.examples < 1:
        print("tqbatch conformance: --examples must be positive", file=sys.stderr)
        return ExitCode.USAGE
    targets = args.targets or _default_targets()
    # A bad target: ImplSpecError, reported by tqbatch.cli.
    impls = [load_impl(ALIASES.get(t, t)) for t in targets]
    rows, own_ok = [], True
    for name, impl in zip(targets, impls):
        result = run_campaign(
            impl, examples=args.examples, profile=args.profile, seed=args.seed, survey=True
        )
        if args.out:
            _save(result, impl, args)
        contract = [
            f["identity"] or f["message"] for f in result.failures if f["level"] != "policy"
        ]
        policy = [f["identity"] for f in result.failures if f["level"] == "policy"]
        rows.append((name, conforms(result), contract, policy, result.examples))
        if ALIASES.get(name, name) == ALIASES["tqbatch"]:
            own_ok = conforms(result) and not policy
        print(_line(rows[-1]), file=sys.stderr if args.markdown else sys.stdout, flush=True)
    if args.markdown:
        print(_markdown(rows, args))
    if not any(examples or contract or policy for _, _, contract, policy, examples in rows):
        print("tqbatch conformance: no target ran an example: nothing was checked", file=sys.stderr)
        code = ExitCode.NOTHING_CHECKED
    else:
        code = ExitCode.OK if own_ok else ExitCode.DEFECT
    step_summary(
        f"### tqbatch conformance\n\nexit {int(code)}: {code.meaning}\n\n" + _markdown(rows, args)
    )
    return code


def _markdown(rows, args) -> str:
    lines = [
        f"<!-- {args.examples} examples, seed {args.seed}, profile {args.profile} -->",
        "| target | conforms | contract failures | policy differences |",
        "|---|---|---|---|",
    ]
    for name, ok, contract, policy, _ in rows:
        lines.append(
            f"| `{name.rsplit(':', 1)[-1] if ':' in name else name}` | {'yes' if ok else 'no'} "
            f"| {_cell(contract)} | {_cell(policy)} |"
        )
    return "\n".join(lines)


def _cell(identities: list[str]) -> str:
    return f"{len(identities)}: " + ", ".join(f"`{i}`" for i in identities) if identities else "-"


def _line(row) -> str:
    name, ok, contract, policy, examples = row
    verdict = "conforms" if ok else "does not conform"
    return (
        f"{name}: {verdict} ({examples} examples); contract failures {len(contract)}"
        + "".join(f"\n    {i}" for i in contract)
        + f"; policy differences {len(policy)}"
        + "".join(f"\n    {i}" for i in policy)
    )


def _save(result, impl, args) -> None:
    from tqbatch.testing.campaign import save_failures
    from tqbatch.testing.impl import impl_spec

    options = {"impl": impl_spec(impl), "survey": True}
    options.update(examples=args.examples, seed=args.seed, profile=args.profile)
    save_failures(result, args.out, backend=args.backend, options=options)
