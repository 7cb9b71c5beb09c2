"""The main job end to end, as a user runs it: `tqbatch fuzz`, then `tqbatch replay`."""

from __future__ import annotations

import json
import subprocess
import sys

from tqbatch.testing import backend

# Fails its first check (size() is an array), so the campaign and its
# shrinking end within seconds.
MUTANT = "tqbatch.testing.mutants:SizeAsArray"


def _tqbatch(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tqbatch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_fuzz_passes_on_tqbatch(tmp_path):
    run = _tqbatch("fuzz", "--examples", "3", "--profile", "ci", "--out", "failures", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "failures" in run.stdout
    assert not (tmp_path / "failures").exists() or not any((tmp_path / "failures").iterdir())


def test_fuzz_failure_is_saved_and_replays(tmp_path):
    run = _tqbatch(
        "fuzz",
        "--impl",
        MUTANT,
        "--examples",
        "5",
        "--profile",
        "ci",
        "--out",
        "failures",
        cwd=tmp_path,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "shrunk op sequence" in run.stdout + run.stderr
    saved = sorted((tmp_path / "failures").glob("*.json"))
    assert len(saved) == 1
    found_on = json.loads(saved[0].read_text())["found_on"]
    # Where it was found, so a GPU-only failure is not chased on a CPU (the
    # command inherits this suite's precision).
    assert found_on["backend"]["precision"] == backend.requested_precision()
    assert found_on["backend"]["matmul_precision"] == backend.matmul_precision()
    assert found_on["options"]["impl"] == MUTANT and "size()" in found_on["error"]

    # The saved scenario reproduces the failure against the mutant...
    again = _tqbatch("replay", str(saved[0]), "--impl", MUTANT, cwd=tmp_path)
    assert again.returncode == 1, again.stdout + again.stderr
    assert "size()" in again.stdout + again.stderr
    # ...and the correct cache passes the same ops against the live oracles.
    fixed = _tqbatch("replay", str(saved[0]), "--oracles-only", "--impl", "tqbatch", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_survey_over_workers_reports_every_shard(tmp_path):
    run = _tqbatch(
        "fuzz", "--impl", MUTANT, "--workers", "2", "--examples", "4", "--profile", "ci",
        "--survey", "--out", "failures", cwd=tmp_path,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "shard 0" in out and "shard 1" in out and "size_type" in out
    saved = sorted((tmp_path / "failures").glob("*.json"))
    assert saved, out
    found_on = json.loads(saved[0].read_text())["found_on"]
    assert found_on["options"]["survey"] is True and found_on["options"]["workers"] == 2
    assert found_on["identity"] == "size_type"


def test_conformance_tabulates_each_target(tmp_path):
    run = _tqbatch("conformance", MUTANT, "tqbatch", "--examples", "3", "--markdown", cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr  # the mutant does not conform
    rows = [line for line in run.stdout.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `SizeAsArray` | no | 1: `size_type` | - |",
        "| `tqbatch` | yes | - | - |",
    ], run.stdout
