"""How fast the state machine finds each mutant, by the check the mutant names.

Under the ``ci`` profile (derandomized: the same examples on every run), per
mutant: seconds and examples until its check first fails, and seconds to
shrink that failure. Reported through pytest-benchmark (one round: the search
is deterministic) and as test properties; the goals (first report: median
<= 10 s, worst <= 60 s; a failure of <= 5 ops shrunk within 30 s, on 2
cores) are read from the report, never asserted on time. What is asserted is
structural: the mutant is found, by its own check.

The default run hunts a few mutants; ``TQBATCH_PERF=full`` (nox ``perf``)
hunts the whole catalogue. ``python -m tqbatch.testing.selfcheck.selftest --markdown``
prints docs/search-speed.md's table.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest

import tqbatch
from tqbatch.testing.mutants import MUTANTS
from tqbatch.testing.selfcheck.selftest import hunt
from tqbatch.workbench import bench

# One of each kind of check in the default run: geometry after a filter, a
# rejected op that half-applies, content after a state round trip.
SMALL = ["FilterWithoutCompaction", "PrepareHalfApplies", "RoundtripAliasesDonor"]
FULL = bench.selected_parameter_set() is bench.FULL
NAMES = sorted(MUTANTS) if FULL else SMALL


@pytest.mark.parametrize("name", NAMES)
def test_time_to_first_report(benchmark, name, record_property):
    benchmark.group = "search: first report (ci profile)"
    result = benchmark.pedantic(hunt, args=(name,), rounds=1, iterations=1)
    assert result.found, f"{name}: {result.failure}"
    benchmark.extra_info.update(examples=result.examples, check=result.check)
    record_property("first report", f"{result.seconds:.1f} s, {result.examples} examples")


@pytest.mark.parametrize("name", NAMES)
def test_time_to_shrunk_report(benchmark, name, record_property):
    benchmark.group = "search: first report, shrunk (ci profile)"
    result = benchmark.pedantic(hunt, args=(name,), kwargs={"shrink": True}, rounds=1)
    assert result.found, f"{name}: {result.failure}"
    benchmark.extra_info.update(shrunk_ops=len(result.failure.ops), check=result.check)
    record_property("shrunk", f"{result.seconds:.1f} s to {len(result.failure.ops)} ops")
    # Shrinking drops ops and lowers values: a sequence cut so far that a correct
    # cache rejects it too (a padding list that no longer matches the rows) would
    # pin the harness's input, not the mutant. tqbatch's own class passes it.
    _replay(tqbatch.BatchTurboQuantKVCache, result.failure)


def _replay(impl, failure):
    from tqbatch.testing.world import World

    world = World(impl, **failure.config)
    for op in failure.ops:
        world.apply(op)
        world.check()


def _campaign():
    from tqbatch.testing.search.campaign import run_campaign

    return run_campaign(tqbatch.BatchTurboQuantKVCache, examples=10, profile="ci", seed=0)


def _ms_per_op(result) -> float:
    assert not result.failures, result.failures
    return 1e3 * result.seconds / sum(result.op_counts.values())


def test_cost_per_example(benchmark, record_property, monkeypatch):
    """Seconds per example of the state machine against tqbatch (ci profile, 10 examples).

    The first campaign of a process also pays what a process pays once
    (the codebooks its configurations ask for, ``test_codebook_solve``):
    reported as ``first_ms_per_op``. The timed campaigns come
    after it. For the ratio, the same campaign with the references' round
    trip through mlx-vlm's own quantize and dequantize (its per-coordinate
    packing loops; as before ``tqbatch.testing.oracles.codec_round_trip``),
    alternated with the default so both see the same load; medians of three.
    """
    from tqbatch.testing.oracles import codec_round_trip

    benchmark.group = "search: cost per example (ci profile, tqbatch)"
    first = _ms_per_op(_campaign())
    plain, packed = [], []
    for _ in range(3):
        plain.append(_ms_per_op(_campaign()))
        with monkeypatch.context() as patched:
            patched.setattr(codec_round_trip, "_plain", lambda codec: False)
            packed.append(_ms_per_op(_campaign()))
    result = benchmark.pedantic(_campaign, rounds=1)
    ops = sum(result.op_counts.values())
    per_example = result.seconds / result.examples
    plain.append(_ms_per_op(result))
    ratio = statistics.median(packed) / statistics.median(plain)
    benchmark.extra_info.update(
        examples=result.examples,
        ops=ops,
        per_example=per_example,
        ms_per_op=statistics.median(plain),
        first_ms_per_op=first,
        ms_per_op_mlx_vlm_round_trip=statistics.median(packed),
        round_trip_ratio=ratio,
    )
    record_property(
        "cost",
        f"{per_example:.2f} s/example, {statistics.median(plain):.1f} ms/op "
        f"(first campaign of the process {first:.1f}; mlx-vlm's own round trip "
        f"{statistics.median(packed):.1f}, x{ratio:.1f})",
    )


# Every (head dim, width) the machine's configurations ask for
# (tests/unit/test_codebooks.py derives them).
_CODEBOOKS = [(dim, bits) for dim in (32, 64, 80, 96, 128, 256) for bits in (2, 3, 4, 6, 8)]


def test_codebook_solve(benchmark, record_property):
    """Seconds to solve the codebooks a survey process asks for: mlx-vlm's ``_codebook``
    and the harness's ``tqbatch.testing.backend.codebooks.solve`` (the same float32
    values), each uncached, alternated; the ratio is the report, with whether campaigns
    use the harness's (only with the mlx-vlm it reproduces)."""
    from mlx_vlm.turboquant import _codebook

    from tqbatch.testing.backend.codebooks import matches_mlx_vlm, solve

    def seconds(function) -> float:
        start = time.perf_counter()
        for dim, bits in _CODEBOOKS:
            function.__wrapped__(dim, bits)  # uncached
        return time.perf_counter() - start

    benchmark.group = "search: codebook solves of a survey process"
    mlx_vlm_seconds, ours = [], []
    for _ in range(2):
        mlx_vlm_seconds.append(seconds(_codebook))
        ours.append(seconds(solve))
    benchmark.pedantic(seconds, args=(solve,), rounds=1)
    ratio = min(mlx_vlm_seconds) / min(ours)
    in_use = matches_mlx_vlm()
    benchmark.extra_info.update(
        codebooks=len(_CODEBOOKS),
        mlx_vlm_s=min(mlx_vlm_seconds),
        solve_s=min(ours),
        ratio=ratio,
        solve_in_use=in_use,
    )
    record_property(
        "codebooks",
        f"{len(_CODEBOOKS)} codebooks: mlx-vlm {min(mlx_vlm_seconds):.2f} s, the harness's "
        f"solve {min(ours):.2f} s (x{ratio:.1f}; "
        f"{'used by campaigns' if in_use else 'not used: another mlx-vlm'})",
    )


# A survey process as the plugin runs it (batch scheduling, one CPU of its own)
# or with either left out (tqbatch.testing.search.scheduling). The settings are
# taken before numpy and MLX load, as tqbatch.testing.search.survey_process takes
# them. Prints its first campaign's ms an op, then the timed campaign's ms an op and
# seconds.
_SURVEY_PROCESS = """
import sys, time
from tqbatch.testing.search.scheduling import batch_scheduling, one_cpu
settings, process, processes = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
if "batch" in settings:
    assert batch_scheduling()
if "one-cpu" in settings:
    assert one_cpu(process, of=processes) is not None
from tqbatch.testing.search.campaign import run_campaign
from tqbatch.testing.target import load_impl
impl = load_impl("tqbatch:BatchTurboQuantKVCache")
first = run_campaign(impl, examples=3, profile="ci", seed=process, survey=True)
print(1e3 * first.seconds / sum(first.op_counts.values()))
start = time.perf_counter()
timed = run_campaign(impl, examples=int(sys.argv[4]), profile="ci", seed=process, survey=True)
print(1e3 * timed.seconds / sum(timed.op_counts.values()), time.perf_counter() - start)
"""


def _survey_processes(settings: str, processes: int, examples: int) -> list[tuple]:
    """(first campaign's ms an op, timed campaign's ms an op, its seconds) of each of
    ``processes`` survey processes (seeds 0, 1, ...) run side by side under ``settings``."""
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SURVEY_PROCESS,
                settings,
                str(p),
                str(processes),
                str(examples),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in range(processes)
    ]
    outputs = [child.communicate()[0] for child in children]
    assert all(child.returncode == 0 for child in children), outputs
    return [tuple(map(float, output.split()[-3:])) for output in outputs]


def _side_by_side(settings: str, examples: int) -> float:
    """Seconds the slower of two survey processes takes, run side by side."""
    return max(seconds for _, _, seconds in _survey_processes(settings, 2, examples))


_SIDE_BY_SIDE = {
    "as the plugin runs them": "batch,one-cpu",
    "SCHED_BATCH only": "batch",
    "neither": "default",
}


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="one CPU each needs two CPUs and Linux's affinity call",
)
def test_two_survey_processes_side_by_side(benchmark, record_property):
    """Seconds of two survey processes side by side as the plugin runs them (``SCHED_BATCH``,
    one CPU each), under ``SCHED_BATCH`` alone and under neither, alternated; medians of
    two. The ratios are the report (docs/search-speed.md, "Two survey processes on two
    cores" and "One CPU for each survey process"); nothing is asserted on time."""
    benchmark.group = "search: two survey processes side by side (tqbatch, ci profile)"
    examples = 60 if FULL else 20
    seconds = {name: [] for name in _SIDE_BY_SIDE}
    for _ in range(2):
        for name, settings in _SIDE_BY_SIDE.items():
            seconds[name].append(_side_by_side(settings, examples))
    benchmark.pedantic(lambda: None, rounds=1)  # the runs above are the measurement
    medians = {name: statistics.median(runs) for name, runs in seconds.items()}
    plugin = medians["as the plugin runs them"]
    benchmark.extra_info.update(examples=examples, **{f"{n} (s)": m for n, m in medians.items()})
    record_property(
        "side by side",
        ", ".join(f"{n}: {m:.1f} s (x{m / plugin:.2f})" for n, m in medians.items()),
    )


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_cost_per_op_in_a_survey_process(benchmark, record_property):
    """ms an op of one survey process alone as the plugin runs it (one CPU, ``SCHED_BATCH``)
    and left to run on every CPU, alternated, medians of three: its first campaign (3
    examples, codebooks included) and the next (10 examples). Nothing is asserted on time."""
    benchmark.group = "search: cost per op in a survey process (tqbatch, ci profile)"
    runs = {"one CPU": [], "every CPU": []}
    for _ in range(3):
        for name, settings in (("one CPU", "batch,one-cpu"), ("every CPU", "default")):
            runs[name] += _survey_processes(settings, 1, 10)
    benchmark.pedantic(lambda: None, rounds=1)  # the runs above are the measurement
    first = {name: statistics.median(f for f, _, _ in r) for name, r in runs.items()}
    warm = {name: statistics.median(w for _, w, _ in r) for name, r in runs.items()}
    benchmark.extra_info.update(first_ms_per_op=first, ms_per_op=warm)
    record_property(
        "cost",
        ", ".join(
            f"{name}: {warm[name]:.2f} ms/op (first campaign {first[name]:.2f})" for name in runs
        ),
    )
