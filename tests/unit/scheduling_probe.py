"""A cache that writes down how its process is scheduled (for ``test_scheduling``)."""

from __future__ import annotations

import json
import os

import tqbatch

ENV = "TQBATCH_TEST_SCHEDULING"  # the file each construction appends a line to


def thread_policies() -> list[int]:
    """The scheduling policy of every thread of this process (Linux), without repeats."""
    return sorted(set(_per_thread(os.sched_getscheduler)))


def thread_cpus() -> list[list[int]]:
    """The CPUs each thread of this process may run on (Linux), without repeats."""
    return [list(cpus) for cpus in sorted(set(_per_thread(_cpus)))]


def _cpus(tid: int) -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(tid)))


def _per_thread(read) -> list:
    """``read(tid)`` of every thread of this process that is still there."""
    seen = []
    for tid in os.listdir("/proc/self/task"):
        try:
            seen.append(read(int(tid)))
        except OSError:  # the thread ended in between
            continue
    return seen


class SchedulingProbe(tqbatch.BatchTurboQuantKVCache):
    """tqbatch's cache, appending its process's id and its threads' policies and CPUs to
    ``$TQBATCH_TEST_SCHEDULING``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        path = os.environ.get(ENV)
        if path:
            seen = {"policies": thread_policies(), "cpus": thread_cpus(), "pid": os.getpid()}
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(seen) + "\n")
