"""``tqbatch conformance``: survey several caches and tabulate their distinct failures; a CI gate.

Each target gets a survey (``tqbatch.testing.search.campaign``, ``--survey`` of
``tqbatch fuzz``) with the same budget and seed, under the derandomization
of a fixed seed: the table is the same on every run. By default the targets
are mlx-vlm's ``BatchTurboQuantKVCache``, tqbatch's cache and the mutants
that reintroduce the omlx seed's defects (the package cannot ship omlx's
code). ``--markdown`` prints the README's conformance table; ``--json`` a
machine-readable result (per target: conforms, contract failures with
identity, what failed, op sequence and scenario file, policy differences,
known / new / no longer failing). Progress goes to stderr, a line per target
and its examples as they run.

As a gate: ``--known-failures FILE`` (every target) or ``TARGET=FILE`` (one
target), repeatable, lists the failures a target is known to have
(``tqbatch.testing.gate.known_failures``). ``--write-known-failures FILE``
writes what one target's survey found in that format, for a human to
review.

Exit codes (``tqbatch.exitcodes``): 1 if any target has a contract failure
that is not in its known failures (with ``--strict-known-failures`` also if
a listed failure was not found); policy differences never fail a run; else 0.
2 a usage error, a target that does not load or a known-failures file that
does not parse; 3 the backend failed its check; 4 the harness extra is
missing; 5 nothing was checked: no target ran an example. The default
targets include caches known not to conform (mlx-vlm's class, the mutants):
without their known failures that run exits 1. Under GitHub Actions the
markdown table is also appended to ``$GITHUB_STEP_SUMMARY``.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from tqbatch.commands import console as make_console
from tqbatch.commands import step_summary
from tqbatch.exitcodes import ExitCode
from tqbatch.testing.target import ALIASES, resolve_alias


def register(subparsers) -> None:
    from tqbatch.commands._gate import add_known_failures_arguments

    parser = subparsers.add_parser(
        "conformance",
        help="survey caches and tabulate every distinct failure; exit 1 on an unknown one",
        description=(
            "Survey each target (as `tqbatch fuzz --survey`) with one budget and seed and "
            "list its distinct failures by level. Exit 1 if a target has a contract failure "
            "that is not among its --known-failures."
        ),
    )
    parser.add_argument(
        "targets",
        nargs="*",
        metavar="TARGET",
        help=f"module:Class or one of {', '.join(ALIASES)} (default: mlx-vlm, tqbatch, the "
        "seed's defects as mutants)",
    )
    parser.add_argument("--examples", type=int, default=60, help="examples per target")
    parser.add_argument("--seed", type=int, default=0, help="survey seed (default 0)")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default: ci)")
    parser.add_argument("--out", default=None, help="also save each failure as a scenario here")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--markdown", action="store_true", help="print a markdown table")
    output.add_argument(
        "--json", action="store_true", help="print the result as JSON (nothing else on stdout)"
    )
    add_known_failures_arguments(parser, per_target=True)
    parser.add_argument(
        "--write-known-failures",
        metavar="FILE",
        help="write the contract failures found (one target) as a known-failures file, each "
        "reason what the check saw, marked for review",
    )
    parser.set_defaults(func=run)


def _default_targets() -> list[str]:
    from tqbatch.testing.mutants import SEED_DEFECTS, import_path

    return ["mlx-vlm", "tqbatch", *(import_path(name) for name in SEED_DEFECTS)]


def _lists_per_target(args, targets, specs) -> dict[str, list[str]]:
    """TARGET -> the known-failures files that apply to it (``ValueError`` for a bad one)."""
    common, own = [], {t: [] for t in targets}
    for arg in args.known_failures:
        name, sep, path = arg.partition("=")
        if sep and name:
            # By the name given, its alias's module:Class, or the class's own spec.
            chosen = [
                t
                for t, spec in zip(targets, specs)
                if resolve_alias(name) in (resolve_alias(t), spec)
            ]
            if not chosen and Path(arg).is_file():  # a file whose name has a '='
                common.append(arg)
                continue
            if not chosen:
                raise ValueError(
                    f"--known-failures {arg}: {name!r} is none of this run's targets "
                    f"({', '.join(targets)})"
                )
            for t in chosen:
                own[t].append(path)
        else:
            common.append(arg)
    return {t: common + own[t] for t in targets}


def run(args) -> int:
    from tqbatch.commands import _gate
    from tqbatch.testing.gate.known_failures import KnownFailuresError
    from tqbatch.testing.search.campaign import run_campaign
    from tqbatch.testing.target import impl_spec, load_impl

    def usage(message: str) -> int:
        print(f"tqbatch conformance: {message}", file=sys.stderr)
        return ExitCode.USAGE

    if args.examples < 1:
        return usage("--examples must be positive")
    targets = args.targets or _default_targets()
    if args.write_known_failures and len(targets) != 1:
        return usage("--write-known-failures writes one target's list: name exactly one target")
    # A bad target: ImplSpecError, reported by tqbatch.cli.
    impls = [load_impl(t) for t in targets]
    specs = [impl_spec(impl) for impl in impls]
    try:
        files = _lists_per_target(args, targets, specs)
        known = {t: _gate.load_known_failures(files[t]) for t in targets}
        files = {t: [str(_gate.known_failures_path(f)) for f in files[t]] for t in targets}
    except (KnownFailuresError, ValueError) as exc:
        return usage(str(exc))

    quiet_stdout = args.markdown or args.json  # stdout is the table / the JSON alone
    progress = _Progress(len(targets), args.examples)
    verdicts = []
    for i, (name, impl) in enumerate(zip(targets, impls)):
        progress.start(i, name)
        result = run_campaign(
            impl,
            examples=args.examples,
            profile=args.profile,
            seed=args.seed,
            survey=True,
            on_example=lambda r: progress.update(r.examples),
        )
        progress.done(result.examples)
        paths = _save(result, impl, args) if args.out else []
        verdict = _gate.verdict_of(name, impl, result, known[name], files[name], paths)
        verdicts.append(verdict)
        stream = sys.stderr if quiet_stdout else sys.stdout
        print(_line(verdict, args.strict_known_failures), file=stream, flush=True)

    if args.write_known_failures:
        command = _command(args, targets)
        n = _gate.write_known_failures(args.write_known_failures, verdicts[0], command)
        print(
            f"tqbatch conformance: wrote {n} known failures of {targets[0]} to "
            f"{args.write_known_failures} (review each reason)",
            file=sys.stderr,
        )
    if not any(v.examples or v.contract or v.policy for v in verdicts):
        print("tqbatch conformance: no target ran an example: nothing was checked", file=sys.stderr)
        code = ExitCode.NOTHING_CHECKED
    elif all(v.passes(args.strict_known_failures) for v in verdicts):
        code = ExitCode.OK
    else:
        code = ExitCode.DEFECT
    for v in verdicts:
        if not v.passes(args.strict_known_failures):
            why = (
                [f"failures not among its known failures {', '.join(v.failing)}"]
                if v.failing
                else []
            )
            if args.strict_known_failures and v.triage.fixed:
                why.append(f"listed but not found {', '.join(v.triage.fixed)}")
            print(f"tqbatch conformance: {v.name}: {'; '.join(why)}", file=sys.stderr)
    if args.markdown:
        print(_markdown(verdicts, args))
    if args.json:
        print(_gate.dumps(_json(verdicts, args, code)))
    step_summary(
        f"### tqbatch conformance\n\nexit {int(code)}: {code.meaning}\n\n"
        + _markdown(verdicts, args)
    )
    return code


class _Progress:
    """Which target is surveyed and its examples so far, on stderr: a live line on a
    terminal, else a line at each quarter of the budget (a CI log)."""

    def __init__(self, targets: int, examples: int):
        self.targets, self.examples = targets, examples
        self.console = make_console(stderr=True)
        self.live = self.console.is_terminal
        self.shown = 0
        self.status = None

    def start(self, i: int, name: str):
        self.name, self.shown = name, 0
        self.head = f"[{i + 1}/{self.targets}] {name}"
        if self.live:
            self.status = self.console.status(self._text(0))
            self.status.start()
        else:
            print(f"surveying {self.head}: {self.examples} examples", file=sys.stderr, flush=True)

    def update(self, done: int):
        if self.live:
            self.status.update(self._text(done))
            return
        step = max(1, self.examples // 4)
        if done // step > self.shown // step and done < self.examples:
            self.shown = done
            print(f"  {self.head}: {done}/{self.examples} examples", file=sys.stderr, flush=True)

    def done(self, done: int):
        if self.status is not None:
            self.status.stop()
            self.status = None

    def _text(self, done: int) -> str:
        from rich.markup import escape

        return escape(f"surveying {self.head}: {done}/{self.examples} examples")


def _command(args, targets) -> str:
    parts = ["tqbatch", "conformance", *targets, "--examples", str(args.examples)]
    parts += ["--seed", str(args.seed), "--profile", args.profile]
    parts += ["--write-known-failures", args.write_known_failures]
    return " ".join(shlex.quote(p) for p in parts)


def _json(verdicts, args, code) -> dict:
    return {
        "command": "conformance",
        "exit_code": int(code),
        "meaning": code.meaning,
        "examples": args.examples,
        "seed": args.seed,
        "profile": args.profile,
        "strict_known_failures": args.strict_known_failures,
        "targets": [v.to_json(args.strict_known_failures) for v in verdicts],
    }


def _markdown(verdicts, args) -> str:
    lines = [
        f"<!-- {args.examples} examples, seed {args.seed}, profile {args.profile} -->",
        "| target | conforms | contract failures | policy differences |",
        "|---|---|---|---|",
    ]
    for v in verdicts:
        contract = [f.key for f in v.contract]
        policy = [f.key for f in v.policy]
        lines.append(
            f"| `{_short(v.name)}` | {'yes' if v.conforms else 'no'} "
            f"| {_cell(contract)} | {_cell(policy)} |"
        )
    judged = [v for v in verdicts if v.known_failures]
    if judged:  # the gate's view, where known failures were given
        lines += [
            "",
            "| target | known failures found | new | no longer fails |",
            "|---|---|---|---|",
        ]
        for v in judged:
            j = v.triage
            lines.append(
                f"| `{_short(v.name)}` | {len(j.known)} | {_cell(v.failing)} | {_cell(j.fixed)} |"
            )
    return "\n".join(lines)


def _short(name: str) -> str:
    return name.rsplit(":", 1)[-1] if ":" in name else name


def _cell(identities: list[str]) -> str:
    return f"{len(identities)}: " + ", ".join(f"`{i}`" for i in identities) if identities else "-"


def _line(verdict, strict: bool) -> str:
    contract = [f.key for f in verdict.contract]
    policy = [f.key for f in verdict.policy]
    verdict_text = "conforms" if verdict.conforms else "does not conform"
    text = (
        f"{verdict.name}: {verdict_text} ({verdict.examples} examples); "
        f"contract failures {len(contract)}"
        + "".join(f"\n    {i}" for i in contract)
        + f"; policy differences {len(policy)}"
        + "".join(f"\n    {i}" for i in policy)
    )
    return "\n".join([text, *verdict.report_lines(strict)])


def _save(result, impl, args) -> list:
    from tqbatch.testing.search.campaign import save_failures
    from tqbatch.testing.target import impl_spec

    options = {"impl": impl_spec(impl), "survey": True}
    options.update(examples=args.examples, seed=args.seed, profile=args.profile)
    return save_failures(result, args.out, backend=args.backend, options=options)
