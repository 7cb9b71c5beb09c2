"""How a survey process asks the OS to schedule it: for throughput, not for wake-up latency.

MLX's CPU backend runs every primitive on a stream thread: the thread that
builds the graph hands each primitive over and wakes the stream thread, and
the harness's small arrays make each hand-over a wake-up. Where a survey
process shares its cores with another (two survey processes on a 2-core
runner), Linux lets each woken thread preempt the thread that woke it, so
every primitive costs two context switches. Under ``SCHED_BATCH`` a woken
thread waits for its turn: the graph is handed over in runs and the switches
fall back to what one process alone has (measured in docs/search-speed.md,
"Two survey processes on two cores"). The examples a process draws, and so
its verdict, do not depend on how it is scheduled.
"""

from __future__ import annotations

import os

__all__ = ["batch_scheduling"]


def batch_scheduling() -> bool:
    """Put every thread of this process, and those it starts later, under ``SCHED_BATCH``.

    Returns whether any thread is under it: False where the OS has no such
    policy (macOS, Windows) or refuses it (a sandbox); nothing else changes then.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        # Threads started before this call (MLX's stream thread) keep their
        # policy unless set one by one; threads started later inherit it.
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # this thread only
    applied = False
    for tid in threads:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:  # a thread that has ended, or a policy the sandbox refuses
            continue
        applied = True
    return applied
