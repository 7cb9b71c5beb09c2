"""``--hypothesis-seed`` is honoured under the derandomized ``ci`` profile (root conftest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
from hypothesis import given, settings, strategies as st
seen = []
@given(st.integers())
def test_probe(x):
    seen.append(x)
def test_report():
    print("DRAWN", settings.default.derandomize, seen[:8])
"""


def _drawn(tmp_path, *args) -> str:
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    # The project first, then whatever the caller's PYTHONPATH holds (an install
    # made available that way, as on a staged GPU machine, must stay importable).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, CI="true", PYTHONPATH=path)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "conftest",
         "--rootdir", str(tmp_path), str(probe), *args],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return next(line for line in run.stdout.splitlines() if "DRAWN" in line)


def test_seed_overrides_derandomize(tmp_path):
    derandomized = _drawn(tmp_path)
    assert "DRAWN True" in derandomized  # the ci profile, loaded because CI is set
    one, two = _drawn(tmp_path, "--hypothesis-seed=1"), _drawn(tmp_path, "--hypothesis-seed=2")
    assert "DRAWN False" in one and one != two
    assert _drawn(tmp_path, "--hypothesis-seed=1") == one  # and the seed reproduces its draws
