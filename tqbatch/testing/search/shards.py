"""A campaign spread over processes: one pytest-xdist worker per shard, one seed each.

``run_shards`` starts ``pytest -n WORKERS`` on this very module, whose one
test, ``test_fuzz_shard``, runs ``campaign_from_options`` with seed
``seed * 1000 + shard`` and keeps its ``CampaignResult`` in a JSON file
(rewritten after every example, so progress can be polled). The parent
adds the shards' results up (``CampaignResult.absorb``): every shard's
failures are kept, each shard's counts are listed. With a ``database``
option every shard opens that one example database: each replays what is
saved there, and what any shard finds is saved there. The test is collected only
when this module is named on the command line with its settings in
``$TQBATCH_FUZZ_SHARD``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tqbatch.testing.search.campaign import (
    CampaignResult,
    contract_identities,
    quiet_stop_round,
    run_campaign,
)
from tqbatch.testing.search.scheduling import batch_scheduling

__all__ = ["campaign_from_options", "run_shards"]

_ENV = "TQBATCH_FUZZ_SHARD"  # JSON settings of a pytest-xdist shard
# A survey process's entry point: it schedules itself before importing this module.
_SURVEY_PROCESS = "tqbatch.testing.search.survey_process"


def campaign_from_options(
    impl, options: dict, seed: int, on_example=None, database=None
) -> CampaignResult:
    """``run_campaign`` with the budget and switches of ``tqbatch fuzz``'s saved options.

    The example database is ``database`` if given (one already opened), else
    the one ``options["database"]`` names (``database_local``: the local
    directory of a ``github:`` spec), else none.
    """
    if database is None and options.get("database"):
        from tqbatch.testing.search.databases import open_database

        database = open_database(options["database"], local=options.get("database_local"))
    return run_campaign(
        impl,
        examples=options["examples"],
        minutes=options["minutes"],
        profile=options["profile"],
        seed=seed,
        survey=options["survey"],
        contract_checks=options["contract_checks"],
        on_example=on_example,
        database=database,
        replay_only=options.get("replay_only", False),
    )


def run_shards(options: dict, progress_update: Callable[[int], None]) -> CampaignResult:
    """Run ``options["workers"]`` shards of the campaign; their results added up.

    ``options["examples"]``, where given, is split between the shards
    exactly (the first shards run one more where it does not divide), so that
    the campaign runs the examples asked for. ``progress_update`` gets the
    examples done so far, about once a second.
    """
    shard_examples = None
    if options["examples"] is not None:
        base, extra = divmod(options["examples"], options["workers"])
        shard_examples = [base + (i < extra) for i in range(options["workers"])]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(
            options=options, shard_examples=shard_examples, workers=options["workers"], dir=tmp
        )
        env = dict(os.environ, **{_ENV: json.dumps(cfg)})
        cmd = [
            # no:benchmark: pytest-benchmark would create .benchmarks/ in the
            # current directory, which must be left as it was.
            sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
            "-p", "no:benchmark",
            "-n", str(options["workers"]), "--rootdir", tmp, "-o", "addopts=",
            "-k", "test_fuzz_shard", "-W", "ignore",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(1.0)
            progress_update(_collect(tmp).examples)
        output = proc.stdout.read().decode(errors="replace")
        total = _collect(tmp)
        if total.examples == 0 and proc.returncode not in (0, 1):
            if options.get("database"):
                # pytest's tracebacks show arguments: the database URL among them.
                from tqbatch.testing.search.databases import redact_text

                output = redact_text(output, options["database"])
            raise RuntimeError(f"pytest-xdist shards did not run:\n{output}")
        return total


def _saver(directory: Path, shard: int) -> Callable[[CampaignResult], None]:
    """Writes a shard's result so far as ``shard-N.json``, with its summary, whole or not at all
    (the parent polls the file while the shard runs)."""
    out = directory / f"shard-{shard}.json"

    def save(result: CampaignResult) -> None:
        _write_whole(out, _summarised(result, shard))

    return save


def _summarised(result: CampaignResult, shard: int) -> dict:
    """``result`` as JSON, with its one shard's summary."""
    data = result.to_json()
    data["shards"] = [
        {
            "shard": shard,
            "examples": result.examples,
            "replayed": result.replayed,
            "failures": len(result.failures),
            "seconds": result.seconds,
        }
    ]
    return data


def _write_whole(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` whole or not at all: the parent reads it while it runs."""
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(data))
    partial.replace(path)


def _collect(directory) -> CampaignResult:
    total = CampaignResult()
    for path in sorted(Path(directory).glob("shard-*.json")):
        try:
            shard = CampaignResult.from_json(json.loads(path.read_text()))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a shard is mid-write; the next poll reads it
        total.absorb(shard)
        total.shards.extend(shard.shards)
    return total


# ------------------------------------------------- the shard, as pytest-xdist runs it


def test_fuzz_shard(shard):
    """One shard of a sharded campaign (collected only by ``run_shards``)."""
    from tqbatch.testing import backend
    from tqbatch.testing.target import load_impl

    batch_scheduling()  # shares the runner's cores with the other shards
    backend.select_device()  # the parent's --device, passed down as $TQBATCH_DEVICE
    cfg = json.loads(os.environ[_ENV])
    save = _saver(Path(cfg["dir"]), shard)

    examples = cfg["shard_examples"]
    options = dict(cfg["options"], examples=None if examples is None else examples[shard])
    impl = load_impl(options["impl"])
    save(campaign_from_options(impl, options, options["seed"] * 1000 + shard, save))


def pytest_generate_tests(metafunc):
    if "shard" in metafunc.fixturenames:
        workers = json.loads(os.environ[_ENV])["workers"]
        metafunc.parametrize("shard", range(workers))


# ------------------------------------------------- a survey spread over processes


def run_in_processes(
    impl_spec: str,
    *,
    processes: int,
    examples: int,
    seed: int,
    campaign: dict,
    quiet_rounds: int | None = None,
    on_update: Callable[[CampaignResult], None] | None = None,
) -> CampaignResult:
    """``run_campaign`` of ``impl_spec`` in ``processes`` processes, their results added up.

    Process ``p`` runs its share of ``examples`` (split exactly, the first
    ones taking one more) under seed ``seed * 1000 + p``, with the keyword
    arguments ``campaign`` (JSON: profile, survey, ...). The examples run
    are a function of these numbers alone, never of the machine's cores or
    speed, so a verdict is the same on every machine that runs the same
    number of processes. ``quiet_rounds``: the survey stops for quiet
    (``campaign.quiet_stop_round``) on the processes' finds added up round
    by round; each process's result is then taken as it was after that
    round, and those still running are stopped, so where it stops does not
    depend on which process ran ahead. ``on_update`` gets the sum so far
    about once a second. The processes start with this one's environment and
    import path (the device asked for is in ``$TQBATCH_DEVICE``), with
    nothing of pytest's: a plain ``python -m tqbatch.testing.search.survey_process``.
    """
    if processes < 1:
        raise ValueError(f"processes must be positive, not {processes}")
    base, extra = divmod(examples, processes)
    shares = [base + (p < extra) for p in range(processes)]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(impl=impl_spec, seed=seed, campaign=campaign, dir=tmp, processes=processes)
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # Output to files, not pipes: a full pipe would stall a process nobody reads yet.
        logs = {p: Path(tmp) / f"process-{p}.log" for p, share in enumerate(shares) if share}
        children = {}
        for p in logs:
            with logs[p].open("wb") as log:
                children[p] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        _SURVEY_PROCESS,
                        tmp,
                        str(p),
                        str(shares[p]),
                        str(os.getpid()),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        rounds = _Rounds(Path(tmp), list(children))
        stop = None
        try:
            while stop is None and any(child.poll() is None for child in children.values()):
                time.sleep(1.0)
                finished = {p: child.poll() is not None for p, child in children.items()}
                stop = rounds.quiet_stop(finished, quiet_rounds)
                if stop is None and on_update is not None:
                    on_update(_collect(tmp))
        finally:
            for child in children.values():
                if child.poll() is None:  # no longer needed (stopped for quiet), or interrupted
                    child.kill()
                    child.wait()
        if stop is None:  # every process ran its share: the rounds may still say where to stop
            stop = rounds.quiet_stop(dict.fromkeys(children, True), quiet_rounds)
        stopped = stop is not None
        failed = [
            p
            for p, child in children.items()
            if child.returncode != 0 and not (stopped and child.returncode == -signal.SIGKILL)
        ]
        if failed:
            output = logs[failed[0]].read_text(errors="replace")
            raise RuntimeError(
                f"{len(failed)} of {len(children)} survey processes failed (process "
                f"{failed[0]}: exit {children[failed[0]].returncode}):\n{output[-4000:]}"
            )
        return _collect(tmp) if stop is None else rounds.total_after(stop)


class _Rounds:
    """The processes' results after each generating round, as they write them."""

    def __init__(self, directory: Path, processes: list[int]):
        self.directory = directory
        self.found: dict[int, list[frozenset]] = {p: [] for p in processes}

    def _read_new(self) -> None:
        for p, found in self.found.items():
            while (path := _round_path(self.directory, p, len(found) + 1)).exists():
                result = CampaignResult.from_json(json.loads(path.read_text()))
                found.append(contract_identities(result))

    def quiet_stop(self, finished: dict[int, bool], quiet_rounds: int | None) -> int | None:
        """The round the survey stops after for quiet, once every process got that far."""
        if not quiet_rounds:
            return None
        self._read_new()
        # Rounds every process has run (or finished before): their finds are final.
        running = [len(f) for p, f in self.found.items() if not finished[p]]
        ready = min(running) if running else max((len(f) for f in self.found.values()), default=0)
        added_up = [
            frozenset().union(*(f[min(r, len(f)) - 1] for f in self.found.values() if f))
            for r in range(1, ready + 1)
        ]
        return quiet_stop_round(added_up, quiet_rounds)

    def total_after(self, stop: int) -> CampaignResult:
        """The processes' results added up, each as it was after round ``stop``."""
        total = CampaignResult(quiet_stop=True)
        for p, found in self.found.items():
            if found:
                path = _round_path(self.directory, p, min(stop, len(found)))
                shard = CampaignResult.from_json(json.loads(path.read_text()))
                total.absorb(shard)
                total.shards.extend(shard.shards)
        return total


def _round_path(directory: Path, process: int, round_: int) -> Path:
    return directory / f"round-{process}-{round_}.json"


def exit_with_parent(parent: int, poll_seconds: float = 1.0) -> None:
    """End this process (exit 1) soon after ``parent``, the process that started it, is gone.

    A survey process whose parent is killed (``kill -9`` of pytest, a
    runner's timeout that stops one process) would otherwise run its whole
    share as an orphan, on the cores the next job needs. The parent's death
    shows as another parent id (the orphan is adopted), on Linux and macOS;
    ``parent`` comes from the parent itself, as it may be gone before this
    process has imported what it needs.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(1)  # noqa: SLF001 - no cleanup is owed to a parent that is gone

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def process_main(cfg: dict, directory: str, process: int, examples: int, parent: int) -> None:
    """One process of ``run_in_processes``: its campaign, kept as ``shard-N.json``, and its
    result after each generating round as ``round-N-R.json``. Started as
    ``tqbatch.testing.search.survey_process``, which reads ``directory``'s configuration
    (``cfg``) and schedules it first."""
    from tqbatch.testing import backend
    from tqbatch.testing.target import load_impl

    exit_with_parent(parent)

    backend.select_device()  # the parent's, through $TQBATCH_DEVICE
    save = _saver(Path(directory), process)
    rounds = 0

    def save_round(result: CampaignResult) -> None:
        nonlocal rounds
        rounds += 1
        _write_whole(_round_path(Path(directory), process, rounds), _summarised(result, process))

    impl = load_impl(cfg["impl"])
    seed = cfg["seed"] * 1000 + process
    save(
        run_campaign(
            impl,
            examples=examples,
            seed=seed,
            on_example=save,
            on_round=save_round,
            **cfg["campaign"],
        )
    )
