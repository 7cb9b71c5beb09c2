"""One exit-code map for every command (``tqbatch.exitcodes``), each code made to happen.

Through the real entry point: ``tqbatch.cli.main`` in-process, or
``python -m tqbatch`` in a subprocess where the process matters (a harness
package made absent, what is left in the current directory). Budgets are a
few examples; the known-broken target (``SizeAsArray``, whose ``size()`` is
an array) fails its first check whatever the seed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import mlx.core as mx
import pytest

import tqbatch.commands
from tqbatch import cli
from tqbatch.exitcodes import HARNESS_MODULES, ExitCode, missing_harness
from tqbatch.testing.replay import golden
from tqbatch.testing.search.campaign import CampaignResult
from tqbatch.workbench import vlm_families

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = golden.DIRECTORY
SIZE = "16_size_is_written_end_int_at_batch"  # merge, filter, update, attend
NO_MERGE = "19_batch_one_left_padding"  # new, prepare, update, attend, extract
# Members in full precision, which only Impl.merge quantizes: skipped without merge.
MERGE_ONLY = "23_full_precision_members_quantized_on_the_way_in"
MUTANT = "tqbatch.testing.mutants:SizeAsArray"
HARNESS_ERROR = re.compile(
    r"tqbatch fuzz: needs the harness extra \(missing: (?P<package>[\w-]+)\): "
    r"pip install 'tqbatch\[harness\]'"
)


def _copy(directory: Path, *names: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        for suffix in (".json", ".npz"):
            shutil.copy(GOLDEN / f"{name}{suffix}", directory / f"{name}{suffix}")
    return directory


def _env(**extra) -> dict:
    """The environment for a subprocess: no step summary, Hypothesis's storage at its default."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GITHUB_STEP_SUMMARY", "HYPOTHESIS_STORAGE_DIRECTORY")
    }
    env.update(extra)
    return env


def _tqbatch(*args: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tqbatch", *args],
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def targets(tmp_path, monkeypatch):
    """A module of targets that lack an operation: ``targets:WithoutMerge``, ``WithoutTrim``."""
    (tmp_path / "targets.py").write_text(
        textwrap.dedent(
            """
            from tqbatch import BatchTurboQuantKVCache

            class WithoutMerge(BatchTurboQuantKVCache):
                merge = None

            class WithoutTrim(BatchTurboQuantKVCache):
                trim = None
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("targets", None)


# ---------------------------------------------------------------- the map


def test_the_map():
    assert [(c.name, int(c)) for c in ExitCode] == [
        ("OK", 0),
        ("DEFECT", 1),
        ("USAGE", 2),
        ("BACKEND", 3),
        ("NO_HARNESS", 4),
        ("NOTHING_CHECKED", 5),
    ]
    # No command keeps codes of its own.
    for module in cli.command_modules():
        assert not [n for n in vars(module) if n.startswith("EXIT_")], module.__name__


def test_harness_modules_are_the_harness_extra():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["harness"]
    packages = {re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0] for requirement in extra}
    assert set(HARNESS_MODULES.values()) == packages


# ---------------------------------------------------------------- 0 and 1


def test_0_clean_and_1_a_defect_replayed(tmp_path):
    _copy(tmp_path, SIZE)
    assert cli.main(["replay", str(tmp_path)]) == ExitCode.OK
    assert cli.main(["replay", "--impl", MUTANT, str(tmp_path)]) == ExitCode.DEFECT


@pytest.mark.parametrize("seed", [0, 1])
def test_1_a_defect_fuzzed(tmp_path, seed):
    out = tmp_path / "failures"
    args = ["fuzz", "--impl", MUTANT, "--examples", "1", "--profile", "ci", "--seed", str(seed)]
    assert cli.main([*args, "--out", str(out)]) == ExitCode.DEFECT
    assert len(list(out.glob("*.json"))) == 1


# ---------------------------------------------------------------- 2


def test_2_a_target_that_does_not_load_or_a_bad_option(tmp_path, capsys):
    assert cli.main(["fuzz", "--impl", "nowhere:Nothing"]) == ExitCode.USAGE
    assert "tqbatch fuzz: implementation 'nowhere:Nothing'" in capsys.readouterr().err
    assert cli.main(["fuzz", "--examples", "0"]) == ExitCode.USAGE
    assert cli.main(["fuzz", "--minutes", "0"]) == ExitCode.USAGE  # not "no time budget"
    assert cli.main(["conformance", "--examples", "0"]) == ExitCode.USAGE
    assert cli.main(["replay", str(tmp_path / "missing.json")]) == ExitCode.USAGE
    with pytest.raises(SystemExit) as exited:  # argparse's own usage error
        cli.main(["fuzz", "--no-such-option"])
    assert exited.value.code == ExitCode.USAGE


# ---------------------------------------------------------------- 3


def test_3_the_backend_fails_its_check(tmp_path, monkeypatch, capsys):
    _copy(tmp_path, SIZE)
    monkeypatch.setattr(
        mx.fast,
        "scaled_dot_product_attention",
        lambda q, k, v, **kw: mx.zeros(q.shape, dtype=q.dtype),
    )
    assert cli.main(["backend"]) == ExitCode.BACKEND
    assert cli.main(["replay", str(tmp_path)]) == ExitCode.BACKEND  # no verdict on the target
    assert "fused attention" in capsys.readouterr().err


# ---------------------------------------------------------------- 4

# Makes the packages named in $ABSENT absent, as if never installed: the path
# finder finds none of their modules (import raises ModuleNotFoundError, and
# importlib.util.find_spec returns None).
_ABSENT = """
import os, sys
from importlib.machinery import PathFinder

ABSENT = set(os.environ["ABSENT"].split(","))

class Absent(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [Absent if f is PathFinder else f for f in sys.meta_path]
"""


def _without(tmp_path, *modules: str) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_ABSENT)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return _env(PYTHONPATH=path, ABSENT=",".join(modules))


def test_4_the_harness_is_not_installed(tmp_path):
    env = _without(tmp_path, "hypothesis", "_hypothesis_globals")
    run = _tqbatch("fuzz", "--examples", "1", cwd=tmp_path, env=env)
    assert run.returncode == ExitCode.NO_HARNESS, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and HARNESS_ERROR.fullmatch(lines[0]), run.stderr
    assert HARNESS_ERROR.fullmatch(lines[0])["package"] == "hypothesis"


def test_4_shards_need_pytest_xdist(tmp_path):
    run = _tqbatch(
        "fuzz", "--examples", "2", "--workers", "2", cwd=tmp_path, env=_without(tmp_path, "xdist")
    )
    assert run.returncode == ExitCode.NO_HARNESS, run.stdout + run.stderr
    assert HARNESS_ERROR.fullmatch(run.stderr.strip())["package"] == "pytest-xdist"


def test_backend_needs_none_of_the_harness(tmp_path):
    run = _tqbatch("backend", cwd=tmp_path, env=_without(tmp_path, *HARNESS_MODULES))
    assert run.returncode == ExitCode.OK, run.stdout + run.stderr
    assert run.stdout.startswith("backend OK")


_RAISES = textwrap.dedent(
    """
    def register(subparsers):
        p = subparsers.add_parser("zzimports")
        p.add_argument("name")
        p.set_defaults(func=run)

    def run(args):
        raise ModuleNotFoundError(f"No module named {args.name!r}", name=args.name)
    """
)


@pytest.fixture
def imports_command(tmp_path, monkeypatch):
    """A command whose run raises ModuleNotFoundError for the module named on its command line."""
    (tmp_path / "zzimports.py").write_text(_RAISES)
    monkeypatch.setattr(tqbatch.commands, "__path__", [*tqbatch.commands.__path__, str(tmp_path)])
    yield
    sys.modules.pop("tqbatch.commands.zzimports", None)


@pytest.mark.parametrize("name", ["not_a_harness_package", "hypothesis.no_such_module"])
def test_any_other_missing_module_is_a_bug_and_raises(imports_command, name):
    # Not a harness package, or one that is installed: no install would fix it.
    with pytest.raises(ModuleNotFoundError):
        cli.main(["zzimports", name])


def test_a_missing_harness_package_is_named(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert missing_harness(ModuleNotFoundError(name="xdist.plugin")) == "pytest-xdist"
    assert missing_harness(ModuleNotFoundError(name="_pytest.config")) == "pytest"
    assert missing_harness(ModuleNotFoundError(name="numpy")) is None
    assert missing_harness(ValueError("hypothesis")) is None


# ---------------------------------------------------------------- 5


def test_5_replay_of_nothing(tmp_path, targets, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["replay", str(empty)]) == ExitCode.NOTHING_CHECKED
    # Every scenario skipped (the target has no merge, which it needs): nothing checked...
    only = _copy(tmp_path / "only", MERGE_ONLY)
    assert cli.main(["replay", "--impl", "targets:WithoutMerge", str(only)]) == 5  # not 3
    # ...but some skipped and the rest green is clean: the skipped are counted.
    some = _copy(tmp_path / "some", MERGE_ONLY, NO_MERGE)
    capsys.readouterr()
    assert cli.main(["replay", "--impl", "targets:WithoutMerge", str(some)]) == ExitCode.OK
    assert "1 passed, 0 diverged, 1 skipped" in capsys.readouterr().out


def test_5_record_and_bench_of_nothing(tmp_path, targets):
    assert cli.main(["record", str(tmp_path)]) == ExitCode.NOTHING_CHECKED
    bench = ["bench", "--impl", "targets:WithoutTrim", "--ops", "trim"]
    assert cli.main(bench) == ExitCode.NOTHING_CHECKED


def test_5_models_where_every_cell_is_not_applicable(capsys):
    not_applicable = dict(vlm_families.SPECS["gemma4"].not_applicable)
    args = ["models", "--families", "gemma4", "--scenarios", *not_applicable]
    assert cli.main(args) == ExitCode.NOTHING_CHECKED
    # The table is not cut where stdout is not a terminal (here: captured).
    brief = f"N/A: {not_applicable['speculative']}"[:39] + "…"
    rows = [line for line in capsys.readouterr().out.splitlines() if "speculative " in line]
    assert rows and all(line.count(brief) == 2 for line in rows), rows  # both columns


def test_5_conformance_and_fuzz_that_ran_no_example(monkeypatch):
    from tqbatch.testing.search import campaign, shards

    monkeypatch.setattr(campaign, "run_campaign", lambda impl, **kw: CampaignResult())
    assert cli.main(["conformance", "tqbatch", "--examples", "1"]) == ExitCode.NOTHING_CHECKED
    monkeypatch.setattr(shards, "campaign_from_options", lambda *a, **kw: CampaignResult())
    assert cli.main(["fuzz", "--examples", "1"]) == ExitCode.NOTHING_CHECKED
