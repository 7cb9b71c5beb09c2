"""A cache that writes down how its process is scheduled (for ``test_scheduling``)."""

from __future__ import annotations

import json
import os

import tqbatch

ENV = "TQBATCH_TEST_SCHEDULING"  # the file each construction appends a line to


def thread_policies() -> list[int]:
    """The scheduling policy of every thread of this process (Linux), without repeats."""
    return sorted({os.sched_getscheduler(tid) for tid in _threads()})


def thread_cpus() -> list[list[int]]:
    """The CPUs each thread of this process may run on (Linux), without repeats."""
    return sorted({tuple(sorted(os.sched_getaffinity(tid))) for tid in _threads()})


def _threads() -> list[int]:
    threads = []
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended in between
            continue
        threads.append(int(tid))
    return threads


class SchedulingProbe(tqbatch.BatchTurboQuantKVCache):
    """tqbatch's cache, appending its process's thread policies and CPUs, and its thread
    count, to ``$TQBATCH_TEST_SCHEDULING``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        path = os.environ.get(ENV)
        if path:
            seen = {"policies": thread_policies(), "cpus": thread_cpus(), "pid": os.getpid()}
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(seen) + "\n")
