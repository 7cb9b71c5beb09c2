"""A cache that writes down how its process is scheduled (for ``test_scheduling``)."""

from __future__ import annotations

import json
import os

import tqbatch

ENV = "TQBATCH_TEST_SCHEDULING"  # the file each construction appends a line to


def thread_policies() -> list[int]:
    """The scheduling policy of every thread of this process (Linux), without repeats."""
    policies = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            policies.add(os.sched_getscheduler(int(tid)))
        except OSError:  # the thread ended in between
            pass
    return sorted(policies)


class SchedulingProbe(tqbatch.BatchTurboQuantKVCache):
    """tqbatch's cache, appending its process's thread policies to ``$TQBATCH_TEST_SCHEDULING``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        path = os.environ.get(ENV)
        if path:
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(thread_policies()) + "\n")
