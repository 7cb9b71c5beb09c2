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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tqbatch.testing.campaign import CampaignResult, run_campaign

__all__ = ["campaign_from_options", "run_shards"]

_ENV = "TQBATCH_FUZZ_SHARD"  # JSON settings of a pytest-xdist shard


def campaign_from_options(
    impl, options: dict, seed: int, on_example=None, database=None
) -> CampaignResult:
    """``run_campaign`` with the budget and switches of ``tqbatch fuzz``'s saved options.

    The example database is ``database`` if given (one already opened), else
    the one ``options["database"]`` names (``database_local``: the local
    directory of a ``github:`` spec), else none.
    """
    if database is None and options.get("database"):
        from tqbatch.testing.databases import open_database

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
                from tqbatch.testing.databases import redact_text

                output = redact_text(output, options["database"])
            raise RuntimeError(f"pytest-xdist shards did not run:\n{output}")
        return total


def _saver(directory: Path, shard: int) -> Callable[[CampaignResult], None]:
    """Writes a shard's result so far as ``shard-N.json``, with its summary, whole or not at all
    (the parent polls the file while the shard runs)."""
    out = directory / f"shard-{shard}.json"

    def save(result: CampaignResult) -> None:
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
        partial = out.with_suffix(".tmp")
        partial.write_text(json.dumps(data))
        partial.replace(out)

    return save


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
    from tqbatch.testing.impl import load_impl

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
    on_update: Callable[[CampaignResult], None] | None = None,
) -> CampaignResult:
    """``run_campaign`` of ``impl_spec`` in ``processes`` processes, their results added up.

    Process ``p`` runs its share of ``examples`` (split exactly, the first
    ones taking one more) under seed ``seed * 1000 + p``, with the keyword
    arguments ``campaign`` (JSON: profile, survey, ...). The examples run
    are a function of these numbers alone, never of the machine's cores or
    speed, so a verdict is the same on every machine that runs the same
    number of processes. ``on_update`` gets the sum so far about once a
    second. The processes start with this one's environment and import path
    (the device asked for is in ``$TQBATCH_DEVICE``), with nothing of
    pytest's: a plain ``python -m tqbatch.testing.shards``.
    """
    if processes < 1:
        raise ValueError(f"processes must be positive, not {processes}")
    base, extra = divmod(examples, processes)
    shares = [base + (p < extra) for p in range(processes)]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(impl=impl_spec, seed=seed, campaign=campaign, dir=tmp)
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # Output to files, not pipes: a full pipe would stall a process nobody reads yet.
        logs = {p: Path(tmp) / f"process-{p}.log" for p, share in enumerate(shares) if share}
        children = {}
        for p in logs:
            with logs[p].open("wb") as log:
                children[p] = subprocess.Popen(
                    [sys.executable, "-m", __name__, tmp, str(p), str(shares[p])],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        try:
            while any(child.poll() is None for child in children.values()):
                time.sleep(1.0)
                if on_update is not None:
                    on_update(_collect(tmp))
        finally:
            for child in children.values():
                if child.poll() is None:  # interrupted: leave no process behind
                    child.kill()
                    child.wait()
        total = _collect(tmp)
        failed = [p for p, child in children.items() if child.returncode != 0]
        if failed:
            output = logs[failed[0]].read_text(errors="replace")
            raise RuntimeError(
                f"{len(failed)} of {len(children)} survey processes failed (process "
                f"{failed[0]}: exit {children[failed[0]].returncode}):\n{output[-4000:]}"
            )
        return total


def _process_main(directory: str, process: int, examples: int) -> None:
    """One process of ``run_in_processes``: its campaign, kept as ``shard-N.json``."""
    from tqbatch.testing import backend
    from tqbatch.testing.impl import load_impl

    backend.select_device()  # the parent's, through $TQBATCH_DEVICE
    cfg = json.loads((Path(directory) / "config.json").read_text())
    save = _saver(Path(directory), process)

    impl = load_impl(cfg["impl"])
    seed = cfg["seed"] * 1000 + process
    save(run_campaign(impl, examples=examples, seed=seed, on_example=save, **cfg["campaign"]))


if __name__ == "__main__":
    _process_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
