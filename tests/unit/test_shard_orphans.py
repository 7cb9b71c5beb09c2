"""A survey process ends soon after the process that started it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# The parent starts a child that watches it, prints the child's pid, and waits.
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1].format(parent=os.getpid())])
print(child.pid, flush=True)
time.sleep(120)
"""
CHILD = (
    "from tqbatch.testing.search.shards import exit_with_parent; import time; {} time.sleep(120)"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (adopted, not yet reaped) has ended too.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return True  # no /proc (macOS): kill(0) is all there is


def _orphan_lives(watch: bool, seconds: float = 10.0) -> bool:
    code = CHILD.format("exit_with_parent({parent}, 0.1);" if watch else "")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, code], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        return _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process adoption")
def test_a_survey_process_exits_when_its_parent_is_killed():
    assert not _orphan_lives(watch=True)
    assert _orphan_lives(watch=False, seconds=3.0)  # without the watch, it would have run on
