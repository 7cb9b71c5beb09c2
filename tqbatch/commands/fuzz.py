"""``tqbatch fuzz``: a bounded property-machine campaign against a target.

Runs ``tqbatch.testing.stateful``'s machine in rounds (each a Hypothesis run
with its own seed) until the example budget or the time budget is spent,
showing a progress bar; then prints a summary (examples, ops, how often each
op ran, op pairs covered, failures). On a failure it prints the shrunk op
sequence, saves it as a golden scenario (``tqbatch.testing.scenario``) and
exits 1. ``--workers N`` runs N shards through pytest-xdist (``-n N``), each
shard a distinct seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqbatch.commands import add_impl_argument

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
ROUND_EXAMPLES = 5  # examples per Hypothesis run: the time budget is checked between runs
_ENV = "TQBATCH_FUZZ_SHARD"  # JSON settings of a pytest-xdist shard


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "fuzz",
        help="run a bounded state-machine campaign against a cache; exit 1 on failure",
        description=(
            "Drive the cache through random op sequences checked against the oracles. "
            "On failure, print the shrunk op sequence, save it as a scenario and exit 1."
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
        help="directory for the failing scenario (default: ./fuzz-failures)",
    )
    parser.add_argument(
        "--no-contract-checks",
        action="store_true",
        help="skip structural contract checks (e.g. no `_idx` attribute) to reach deeper bugs",
    )
    parser.set_defaults(func=run)


@dataclass
class CampaignResult:
    examples: int = 0
    op_counts: dict = field(default_factory=dict)
    pair_counts: dict = field(default_factory=dict)
    failure: dict | None = None
    seconds: float = 0.0

    def absorb(self, other: CampaignResult):
        self.examples += other.examples
        for name, n in other.op_counts.items():
            self.op_counts[name] = self.op_counts.get(name, 0) + n
        for pair, n in other.pair_counts.items():
            self.pair_counts[pair] = self.pair_counts.get(pair, 0) + n
        self.failure = self.failure or other.failure
        self.seconds = max(self.seconds, other.seconds)

    def to_json(self) -> dict:
        data = asdict(self)
        data["pair_counts"] = {" > ".join(k): v for k, v in self.pair_counts.items()}
        return data

    @classmethod
    def from_json(cls, data: dict) -> CampaignResult:
        pairs = {tuple(k.split(" > ")): v for k, v in data["pair_counts"].items()}
        return cls(data["examples"], data["op_counts"], pairs, data["failure"], data["seconds"])


def campaign(
    impl, *, examples, minutes, profile, seed, on_example=None, contract_checks=True
) -> CampaignResult:
    """Run the machine against ``impl`` until ``examples`` or ``minutes`` is spent."""
    from hypothesis import Phase, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.stateful import run_state_machine_as_test

    from tqbatch.testing.profiles import register_profiles
    from tqbatch.testing.stateful import UnsupportedOpsWarning, machine_for

    register_profiles()
    base = settings.get_profile(profile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsupportedOpsWarning)
        machine = machine_for(impl, contract_checks=contract_checks)
    result = CampaignResult()

    class Counting(machine):
        def teardown(self):
            result.examples += 1
            if on_example:
                on_example(result)

    start = time.monotonic()
    deadline = start + minutes * 60 if minutes else None
    round_no = 0
    while True:
        if examples is not None and result.examples >= examples:
            break
        if deadline is not None and time.monotonic() >= deadline:
            break
        n = ROUND_EXAMPLES if examples is None else min(ROUND_EXAMPLES, examples - result.examples)
        round_settings = settings(
            base,
            max_examples=n,
            derandomize=False,
            database=None,
            phases=[Phase.generate, Phase.shrink],
        )

        def factory():
            return Counting()

        hypothesis_seed(seed * 1_000_003 + round_no)(factory)
        round_no += 1
        try:
            run_state_machine_as_test(factory, settings=round_settings)
        except Exception as exc:  # the machine recorded the shrunk failure
            failure = Counting.last_failure
            result.failure = (
                asdict(failure)
                if failure is not None
                else {"impl": "", "config": {}, "ops": [], "message": repr(exc)}
            )
            break
    result.op_counts = dict(Counting.op_counts)
    result.pair_counts = dict(Counting.pair_counts)
    result.seconds = time.monotonic() - start
    return result


# ---------------------------------------------------------------- pytest-xdist shards


def test_fuzz_shard(shard):
    """One shard of a ``--workers`` campaign (collected only by ``tqbatch fuzz``)."""
    from tqbatch.testing import backend
    from tqbatch.testing.impl import load_impl

    backend.select_device()  # the parent's --device, passed down as $TQBATCH_DEVICE
    cfg = json.loads(os.environ[_ENV])
    out = Path(cfg["dir"]) / f"shard-{shard}.json"

    def save(result):
        out.write_text(json.dumps(result.to_json()))

    result = campaign(
        load_impl(cfg["impl"]),
        examples=cfg["examples"],
        minutes=cfg["minutes"],
        profile=cfg["profile"],
        seed=cfg["seed"] * 1000 + shard,
        on_example=save,
        contract_checks=cfg["contract_checks"],
    )
    save(result)


def pytest_generate_tests(metafunc):
    if "shard" in metafunc.fixturenames:
        workers = json.loads(os.environ[_ENV])["workers"]
        metafunc.parametrize("shard", range(workers))


def _run_workers(args, progress_update) -> CampaignResult:
    shard_examples = None
    if args.examples is not None:
        shard_examples = -(-args.examples // args.workers)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(
            impl=args.impl,
            examples=shard_examples,
            minutes=args.minutes,
            profile=args.profile,
            seed=args.seed,
            workers=args.workers,
            dir=tmp,
            contract_checks=not args.no_contract_checks,
        )
        env = dict(os.environ, **{_ENV: json.dumps(cfg)})
        cmd = [
            sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
            "-n", str(args.workers), "--rootdir", tmp, "-o", "addopts=",
            "-k", "test_fuzz_shard", "-W", "ignore",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(1.0)
            progress_update(_collect(tmp).examples)
        output = proc.stdout.read().decode(errors="replace")
        total = _collect(tmp)
        if total.examples == 0 and proc.returncode not in (0, 1):
            raise RuntimeError(f"pytest-xdist shards did not run:\n{output}")
        return total


def _collect(directory) -> CampaignResult:
    total = CampaignResult()
    for path in sorted(Path(directory).glob("shard-*.json")):
        try:
            total.absorb(CampaignResult.from_json(json.loads(path.read_text())))
        except (json.JSONDecodeError, KeyError):
            continue  # a shard is mid-write; the next poll reads it
    return total


# ---------------------------------------------------------------- command


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from tqbatch.testing.backend import describe_line
    from tqbatch.testing.impl import ImplSpecError, load_impl, missing_capabilities
    from tqbatch.testing.ops import format_ops

    console = Console(stderr=True)
    try:
        impl = load_impl(args.impl)
    except ImplSpecError as exc:
        console.print(f"[red]{exc}[/red]")
        return EXIT_USAGE
    if args.workers < 1 or (args.examples is not None and args.examples < 1):
        console.print("[red]--workers and --examples must be positive[/red]")
        return EXIT_USAGE
    if args.examples is None and args.minutes is None:
        args.minutes = 2.0
    args.impl = f"{impl.__module__}:{impl.__qualname__}"
    missing = missing_capabilities(impl)
    if missing:
        console.print(f"{args.impl} lacks {', '.join(missing)}: those rules are skipped")

    total = args.examples
    with Progress(
        TextColumn("fuzzing {task.fields[impl]}"),
        BarColumn(),
        TextColumn("{task.completed} examples"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("fuzz", total=total, impl=args.impl)
        if args.workers > 1:
            result = _run_workers(args, lambda n: progress.update(task, completed=n))
        else:
            result = campaign(
                impl,
                examples=args.examples,
                minutes=args.minutes,
                profile=args.profile,
                seed=args.seed,
                on_example=lambda r: progress.update(task, completed=r.examples),
                contract_checks=not args.no_contract_checks,
            )

    table = Table(title="tqbatch fuzz summary")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("target", args.impl)
    table.add_row("backend", describe_line(args.backend))
    table.add_row("examples", str(result.examples))
    table.add_row("ops", str(sum(result.op_counts.values())))
    table.add_row("seconds", f"{result.seconds:.0f}")
    for name, n in sorted(result.op_counts.items()):
        table.add_row(f"  op {name}", str(n))
    table.add_row("op pairs covered", str(len(result.pair_counts)))
    table.add_row("failures", "1" if result.failure else "0")
    table.add_row("skipped (unsupported)", ", ".join(missing) or "-")
    Console().print(table)

    if not result.failure:
        return EXIT_OK
    failure = result.failure
    console.print(f"[red]FAILED[/red]: {failure['message']}")
    console.print("shrunk op sequence:\n" + format_ops(failure["ops"]))
    if failure["ops"]:
        from tqbatch.testing.scenario import write_failure

        path = write_failure(
            failure["ops"],
            failure["config"],
            args.out,
            error=failure["message"],
            backend=args.backend,
            options={
                "impl": args.impl,
                "profile": args.profile,
                "seed": args.seed,
                "workers": args.workers,
                "contract_checks": not args.no_contract_checks,
            },
        )
        console.print(f"saved as a scenario: {path}  (reproduce: tqbatch replay {path})")
    return EXIT_FAILED
