"""Survey processes ask Linux for batch scheduling and a CPU each
(``tqbatch.testing.search.scheduling``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tqbatch.testing.search import scheduling
from tqbatch.testing.search.scheduling import spread
from tqbatch.testing.search.shards import run_in_processes

from .scheduling_probe import ENV

linux_only = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is a Linux scheduling policy"
)
affinity_only = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's"
)


@linux_only
def test_every_thread_is_put_under_batch_scheduling_and_later_ones_inherit_it():
    before, after, threads = _around(
        "thread_policies()",
        "batch_scheduling()",
        "from tqbatch.testing.search.scheduling "
        "import batch_scheduling; from tests.unit.scheduling_probe import thread_policies",
    )
    assert before == [os.SCHED_OTHER]
    assert after == [os.SCHED_BATCH]
    assert threads >= 4  # main, MLX's stream thread, the thread before and the one after


@linux_only
def test_survey_processes_run_under_batch_scheduling_each_on_a_cpu_of_its_own(
    tmp_path, monkeypatch
):
    record = tmp_path / "seen.jsonl"
    monkeypatch.setenv(ENV, str(record))
    result = run_in_processes(
        "tests.unit.scheduling_probe:SchedulingProbe",
        processes=2,
        examples=2,
        seed=0,
        campaign=dict(profile="ci", survey=True),
    )
    assert result.examples == 2
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    assert {tuple(s["policies"]) for s in seen} == {(os.SCHED_BATCH,)}
    by_process = {s["pid"]: s["cpus"] for s in seen}
    assert len(by_process) == 2
    order = spread(os.sched_getaffinity(0), scheduling._siblings)
    if len(order) >= 2:
        # Every thread of a process on its one CPU; the two processes on two.
        assert sorted(by_process.values()) == [[[order[0]]], [[order[1]]]]
    else:  # one CPU for two processes: left to the OS, unpinned
        assert all(cpus == [sorted(os.sched_getaffinity(0))] for cpus in by_process.values())


@affinity_only
def test_every_thread_is_put_on_one_cpu_and_later_ones_inherit_it():
    first = spread(os.sched_getaffinity(0), scheduling._siblings)[0]
    before, after, threads = _around(
        "thread_cpus()",
        f"one_cpu(0, of=1) == {first}",
        "from tqbatch.testing.search.scheduling "
        "import one_cpu; from tests.unit.scheduling_probe import thread_cpus",
    )
    assert before == [sorted(os.sched_getaffinity(0))]
    assert after == [[first]]
    assert threads >= 4  # main, MLX's stream thread, the thread before and the one after


@affinity_only
def test_more_processes_than_cpus_are_left_to_the_os(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "sched_setaffinity", lambda *args: calls.append(args))
    assert scheduling.one_cpu(2, of=3) is None
    assert calls == []
    assert scheduling.one_cpu(1, of=2) == 1
    assert calls and all(cpus == {1} for _, cpus in calls)


def test_without_an_affinity_call_nothing_changes(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    assert scheduling.one_cpu(0, of=1) is None


@pytest.mark.parametrize(
    "cpus, cores, order",
    [
        ({0, 1, 2, 3}, [{0}, {1}, {2}, {3}], [0, 1, 2, 3]),  # no hardware threads
        ({0, 1, 2, 3}, [{0, 2}, {1, 3}], [0, 1, 2, 3]),  # siblings numbered a core apart
        ({0, 1, 2, 3}, [{0, 1}, {2, 3}], [0, 2, 1, 3]),  # siblings numbered side by side
        ({1, 2, 3}, [{0, 1}, {2, 3}], [1, 2, 3]),  # CPU 0 not ours: its sibling leads
        ({4, 5}, [{4, 5}], [4, 5]),  # one core: its threads in turn
    ],
)
def test_processes_take_one_cpu_of_each_core_before_a_second(cpus, cores, order):
    def siblings(cpu):
        return frozenset(next(core for core in cores if cpu in core))

    assert spread(cpus, siblings) == order


@pytest.mark.parametrize(
    "text, cpus", [("0", [0]), ("0-3\n", [0, 1, 2, 3]), ("0-1,4,6-7", [0, 1, 4, 6, 7])]
)
def test_linux_cpu_lists_are_read(text, cpus):
    assert scheduling._cpu_list(text) == cpus


def test_a_survey_process_takes_its_cpu_before_loading_numpy_or_mlx():
    # numpy's BLAS sizes its thread pool from the CPUs it may use when it loads.
    script = (
        "import sys, tqbatch.testing.search.survey_process; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'numpy', 'mlx', 'mlx_lm', 'mlx_vlm', 'hypothesis', 'scipy'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=_root()
    )
    assert out.stdout.strip() == "[]"


def test_without_the_policy_nothing_changes(monkeypatch):
    monkeypatch.delattr(os, "SCHED_BATCH", raising=False)
    assert scheduling.batch_scheduling() is False


def _around(read: str, call: str, imports: str) -> tuple:
    """In a process of its own (the test process keeps how it is scheduled): ``read`` before
    and after ``call`` (which must be true), with MLX's stream thread and a thread started
    before the call alive and one started after it; and the process's thread count."""
    script = textwrap.dedent(
        f"""
        import json, os, threading
        import mlx.core as mx
        {imports}

        mx.eval(mx.arange(4) + 1)  # MLX's stream thread exists before the call
        stop = threading.Event()
        before = threading.Thread(target=stop.wait)
        before.start()
        read_before = {read}
        assert {call}
        after = threading.Thread(target=stop.wait)
        after.start()
        print(json.dumps([read_before, {read}, len(os.listdir("/proc/self/task"))]))
        stop.set()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=_root()
    )
    return tuple(json.loads(out.stdout))


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
