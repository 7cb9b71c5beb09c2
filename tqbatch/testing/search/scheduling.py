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

Each hand-over that finds the stream thread asleep on another CPU also
waits for that CPU to wake (an inter-processor interrupt; on a virtual
machine, a virtual CPU brought back from halt). On the same CPU it is a
context switch. A survey process puts its threads on one CPU of its own
(``one_cpu``), so that its hand-overs stay there: one MLX evaluation of a
single addition took 64 µs across two CPUs and 12 µs on one (docs/search-speed.md,
"One CPU for each survey process").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

__all__ = ["batch_scheduling", "one_cpu", "spread"]


def batch_scheduling() -> bool:
    """Put every thread of this process, and those it starts later, under ``SCHED_BATCH``.

    Returns whether any thread is under it: False where the OS has no such
    policy (macOS, Windows) or refuses it (a sandbox); nothing else changes then.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    return _every_thread(lambda tid: os.sched_setscheduler(tid, policy, os.sched_param(0)))


def one_cpu(index: int, of: int) -> int | None:
    """Put every thread of this process, and those it starts later, on one CPU.

    This process is number ``index`` (from 0) of ``of`` processes that share
    the CPUs it may run on: it takes the ``index``-th of those CPUs in
    ``spread`` order, so that each process has a core of its own while there
    are cores enough. Returns
    the CPU, or None where nothing changed: where the OS has no affinity call
    (macOS, Windows) or refuses it, or where the processes outnumber the
    CPUs (pinned, two would share one while the OS could have balanced them).
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = spread(os.sched_getaffinity(0), _siblings)
    if of > len(cpus):
        return None
    cpu = cpus[index]
    return cpu if _every_thread(lambda tid: os.sched_setaffinity(tid, {cpu})) else None


def spread(cpus: Iterable[int], siblings: Callable[[int], frozenset[int]]) -> list[int]:
    """``cpus`` in the order survey processes take them: one CPU of each core, then a second.

    ``siblings(cpu)``: the CPUs that share ``cpu``'s core (hardware threads),
    itself included. Two processes on two threads of one core would share its
    execution units while another core idles.
    """
    cpus = set(cpus)
    cores: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(min(siblings(cpu) & cpus | {cpu}), []).append(cpu)
    groups = [cores[first] for first in sorted(cores)]
    depth = max((len(group) for group in groups), default=0)
    return [group[rank] for rank in range(depth) for group in groups if rank < len(group)]


def _siblings(cpu: int) -> frozenset[int]:
    """The CPUs of ``cpu``'s core as Linux lists them (``0-1,4``); ``{cpu}`` where it does not."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            with open(f"{topology}/{name}", encoding="ascii") as listed:
                return frozenset(_cpu_list(listed.read()))
        except (OSError, ValueError):
            continue
    return frozenset({cpu})


def _cpu_list(text: str) -> list[int]:
    """Linux's CPU list format: ``0-3,8`` is 0, 1, 2, 3 and 8."""
    cpus = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def _every_thread(apply: Callable[[int], object]) -> bool:
    """``apply(tid)`` for every thread of this process; whether it took for any.

    Threads started before the call (MLX's stream thread) keep their policy and
    CPUs unless set one by one; threads started later inherit the setting of
    the thread that starts them.
    """
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # the calling thread only, where /proc does not list them
    applied = False
    for tid in threads:
        try:
            apply(tid)
        except OSError:  # a thread that has ended, or a call the sandbox refuses
            continue
        applied = True
    return applied
