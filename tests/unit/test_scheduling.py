"""Survey processes ask Linux for batch scheduling (``tqbatch.testing.search.scheduling``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tqbatch.testing.search.shards import run_in_processes

from .scheduling_probe import ENV

linux_only = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is a Linux scheduling policy"
)


@linux_only
def test_every_thread_is_put_under_batch_scheduling_and_later_ones_inherit_it():
    # In a process of its own: the test process keeps its scheduling.
    script = textwrap.dedent(
        """
        import os, threading
        import mlx.core as mx
        from tests.unit.scheduling_probe import thread_policies
        from tqbatch.testing.search.scheduling import batch_scheduling

        mx.eval(mx.arange(4) + 1)  # MLX's stream thread exists before the call
        stop = threading.Event()
        before = threading.Thread(target=stop.wait)
        before.start()
        assert thread_policies() == [os.SCHED_OTHER], thread_policies()
        assert batch_scheduling()
        after = threading.Thread(target=stop.wait)
        after.start()
        print(thread_policies(), os.SCHED_BATCH, len(os.listdir("/proc/self/task")))
        stop.set()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=_root()
    ).stdout.split()
    policies, batch, threads = json.loads(out[0]), int(out[1]), int(out[2])
    assert policies == [batch]
    assert threads >= 4  # main, MLX's stream thread, the thread before and the one after


@linux_only
def test_survey_processes_run_under_batch_scheduling(tmp_path, monkeypatch):
    record = tmp_path / "policies.jsonl"
    monkeypatch.setenv(ENV, str(record))
    result = run_in_processes(
        "tests.unit.scheduling_probe:SchedulingProbe",
        processes=2,
        examples=2,
        seed=0,
        campaign=dict(profile="ci", survey=True),
    )
    assert result.examples == 2
    seen = {tuple(json.loads(line)) for line in record.read_text().splitlines()}
    assert seen == {(os.SCHED_BATCH,)}


def test_without_the_policy_nothing_changes(monkeypatch):
    from tqbatch.testing.search import scheduling

    monkeypatch.delattr(os, "SCHED_BATCH", raising=False)
    assert scheduling.batch_scheduling() is False


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
