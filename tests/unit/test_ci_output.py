"""What the commands leave in a CI log, a job summary and the current directory.

- Rich tables are not cut where stdout is not a terminal (a CI log).
- Under GitHub Actions (``$GITHUB_STEP_SUMMARY``) each command appends a
  markdown summary of its run.
- ``fuzz --examples N`` reports N examples, in one process or in shards.
- A command leaves nothing in the current directory but what was asked for.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tqbatch import cli
from tqbatch.commands import UNCUT_WIDTH, console, models
from tqbatch.exitcodes import ExitCode
from tqbatch.testing import backend
from tqbatch.testing.replay import golden
from tqbatch.testing.search.campaign import CampaignResult, _Counter
from tqbatch.workbench import vlm_families

GOLDEN = golden.DIRECTORY
SIZE = "16_size_is_written_end_int_at_batch"
MUTANT = "tqbatch.testing.mutants:SizeAsArray"


def _fuzz(*args: str, cwd) -> subprocess.CompletedProcess:
    """``python -m tqbatch fuzz`` as CI runs it: stdout a pipe, no summary, Hypothesis's default."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GITHUB_STEP_SUMMARY", "HYPOTHESIS_STORAGE_DIRECTORY")
    }
    return subprocess.run(
        [sys.executable, "-m", "tqbatch", "fuzz", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _row(out: str, quantity: str) -> str:
    """The value of a row of the fuzz summary table."""
    match = re.search(rf"│ {re.escape(quantity)} +│ +(.+?) +│", out)
    assert match, out
    return match[1]


# ---------------------------------------------------------------- the current directory


def test_fuzz_reports_its_budget_and_leaves_nothing_behind(tmp_path):
    # Runs Hypothesis gives up on were counted as examples, and
    # `--examples 5` (nightly profile, seed 0) reported 6: see
    # test_an_example_hypothesis_gave_up_on_is_not_counted, which does not
    # depend on what Hypothesis draws.
    run = _fuzz("--examples", "2", "--profile", "ci", cwd=tmp_path)
    assert run.returncode == ExitCode.OK, run.stdout + run.stderr
    assert _row(run.stdout, "examples") == "2"
    # The table is not cut to 80 columns: the backend's whole line on one row.
    # (Up to the launch count: that is each process's own, and this one's may have run
    # the fused CUDA decode kernel already.)
    launched = ", launched so far:"
    want = backend.describe_line(backend.check_backend()).split(launched)[0]
    assert _row(run.stdout, "backend").split(launched)[0] == want
    assert sorted(os.listdir(tmp_path)) == []  # no .hypothesis/, no fuzz-failures/


def test_fuzz_shards_split_the_budget_and_leave_nothing_behind(tmp_path):
    run = _fuzz("--examples", "3", "--workers", "2", "--profile", "ci", cwd=tmp_path)
    assert run.returncode == ExitCode.OK, run.stdout + run.stderr
    assert _row(run.stdout, "examples") == "3"
    shards = sorted(re.findall(r"shard (\d) +│ +(\d+) examples", run.stdout))
    assert shards == [("0", "2"), ("1", "1")], run.stdout
    assert sorted(os.listdir(tmp_path)) == []  # no .benchmarks/, no .hypothesis/


@pytest.mark.parametrize("budget", [1, 3])
def test_an_example_hypothesis_gave_up_on_is_not_counted(budget):
    result = CampaignResult()
    counter = _Counter(result, None)

    def run(status):
        counter.example_done({"update": 2}, {("update", "attend"): 1})
        how = "during generate phase"
        counter.observe(SimpleNamespace(type="test_case", how_generated=how, status=status))

    for _ in range(budget):
        run("passed")
        run("gave_up")
    assert result.examples == budget
    assert result.op_counts == {"update": 4 * budget}  # its ops ran, and are counted


# ---------------------------------------------------------------- uncut tables


def test_a_console_is_full_width_off_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert console().width == UNCUT_WIDTH

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setenv("COLUMNS", "80")
    assert console(stderr=True).width == 80


# ---------------------------------------------------------------- the job summary


@pytest.fixture
def summary(tmp_path, monkeypatch):
    path = tmp_path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(path))
    return path


def test_fuzz_summary_names_each_failure_and_its_scenario(tmp_path, summary):
    out = tmp_path / "failures"
    args = ["fuzz", "--impl", MUTANT, "--examples", "1", "--profile", "ci", "--out", str(out)]
    assert cli.main(args) == ExitCode.DEFECT
    text = summary.read_text()
    (saved,) = out.glob("*.json")
    assert text.startswith("### tqbatch fuzz\n\nexit 1: the target has a defect")
    assert f"| target | `{MUTANT}` |" in text and "| examples | 1 |" in text
    assert "| ops |" in text and "| failures | 1 |" in text
    failure = next(line for line in text.splitlines() if line.startswith("| `size_type`"))
    assert f"`{saved}`" in failure and "| contract |" in failure


def test_replay_summary_counts(tmp_path, summary):
    for suffix in (".json", ".npz"):
        shutil.copy(GOLDEN / f"{SIZE}{suffix}", tmp_path / f"{SIZE}{suffix}")
    assert cli.main(["replay", str(tmp_path / f"{SIZE}.json")]) == ExitCode.OK
    assert cli.main(["replay", "--impl", MUTANT, str(tmp_path / f"{SIZE}.json")]) == 1
    first, second = summary.read_text().strip().split("\n\n### ")
    assert first.endswith("exit 0: clean; 1 passed, 0 diverged, 0 skipped")
    assert "exit 1: the target has a defect; 0 passed, 1 diverged, 0 skipped" in second
    assert f"- `{SIZE}`: op 0 " in second and "[size_type] size() returned array" in second


def test_conformance_summary_is_its_markdown_table(summary):
    assert cli.main(["conformance", MUTANT, "--examples", "1"]) == ExitCode.DEFECT
    text = summary.read_text()
    assert text.startswith("### tqbatch conformance\n\nexit 1: the target has a defect")
    assert "| target | conforms | contract failures | policy differences |" in text
    assert "| `SizeAsArray` | no | 1: `size_type` | - |" in text


def test_models_summary_is_its_markdown_table(summary):
    args = ["models", "--families", "gemma4", "--scenarios", "speculative"]
    assert cli.main(args) == ExitCode.NOTHING_CHECKED
    text = summary.read_text()
    assert text.startswith("### tqbatch models\n\nexit 5: nothing was checked")
    assert "| family | scenario | tqbatch | BatchKVCache |" in text
    why = dict(vlm_families.SPECS["gemma4"].not_applicable)["speculative"]
    # Cell.brief(): the model-family table cuts a cell to models.WIDTH characters.
    brief = f"N/A: {why}"[: models.WIDTH - 1] + "…"
    assert len(f"N/A: {why}") > models.WIDTH  # so that the cut is what is checked
    assert f"| gemma4 | speculative | {brief} | {brief} |" in text


def test_an_unwritable_summary_does_not_change_the_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path / "no-such-dir" / "summary.md"))
    assert cli.main(["replay", str(GOLDEN / f"{SIZE}.json")]) == ExitCode.OK
    assert "cannot write the step summary" in capsys.readouterr().err


def test_no_summary_outside_github_actions(tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["replay", str(GOLDEN / f"{SIZE}.json")]) == ExitCode.OK
    assert os.listdir(tmp_path) == []
