"""The CLI as another cache's CI gate: known failures, replay where found, aliases, capabilities.

- ``conformance`` exits 1 on a contract failure not in the target's known
  failures, 0 when every failure is listed; a listed failure not found is
  reported (and fails only ``--strict-known-failures``); ``--json`` says all
  of it; ``--write-known-failures`` writes a list the same run passes with.
- ``fuzz --known-failures`` judges its survey the same way.
- ``replay FILE`` replays a saved failure against the target it was found on.
- ``tqbatch`` and ``mlx-vlm`` name targets in every command.
- A constructor without ``key_bits``/``value_bits`` or ``seed`` is a missing
  capability: those configurations are not drawn and are reported as
  unsupported, never as a defect.

The broken targets fail their first check whatever the seed: ``SizeAsArray``
(``size()`` is an array) and ``SizeAsArrayWithIdx`` (that, and an ``_idx``
attribute beside packed keys: ``structure``), so a budget of two examples
finds every failure on any seed.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from hypothesis import given

from tqbatch import cli
from tqbatch.exitcodes import ExitCode
from tqbatch.testing.contract import strategies as tqs
from tqbatch.testing.contract.ops import bad_input_cases
from tqbatch.testing.gate.known_failures import KnownFailures
from tqbatch.testing.replay import golden
from tqbatch.testing.replay.replayer import replay
from tqbatch.testing.replay.scenario import Scenario
from tqbatch.testing.selfcheck.doubles import WithoutSeed, WithoutSplitBits
from tqbatch.testing.target import (
    capabilities,
    load_impl,
    missing_capabilities,
    unsupported_configurations,
)
from tqbatch.testing.world import UnsupportedOp, World

MUTANT = "tqbatch.testing.mutants:SizeAsArray"
TWO_DEFECTS = "gate_targets:SizeAsArrayWithIdx"
BUDGET = ["--examples", "2", "--seed", "0"]


@pytest.fixture
def gate_targets(tmp_path, monkeypatch):
    """``gate_targets:SizeAsArrayWithIdx``: SizeAsArray's defect and one more, ``structure``."""
    (tmp_path / "gate_targets.py").write_text(
        textwrap.dedent(
            """
            from tqbatch.testing.mutants import SizeAsArray

            class SizeAsArrayWithIdx(SizeAsArray):
                _idx = 0  # mlx-vlm's rollback would take this cache for a dense KVCache
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("gate_targets", None)


@pytest.fixture
def known(tmp_path):
    path = tmp_path / "known.txt"
    path.write_text("# SizeAsArray\nsize_type  # size() returns the offsets array\n")
    return path


# ---------------------------------------------------------------- conformance


def test_conformance_fails_only_on_failures_not_known(known, gate_targets, capsys):
    assert cli.main(["conformance", MUTANT, *BUDGET]) == ExitCode.DEFECT
    assert cli.main(["conformance", MUTANT, *BUDGET, "--known-failures", str(known)]) == 0
    capsys.readouterr()
    # One more defect, not listed: the gate fails again, naming it.
    two = ["conformance", TWO_DEFECTS, *BUDGET, "--known-failures", str(known)]
    assert cli.main(two) == ExitCode.DEFECT
    out, err = capsys.readouterr()
    assert "NEW: structure is not a known failure" in out
    assert "size_type" not in err.rpartition("failures not among its known failures")[2]
    assert f"{TWO_DEFECTS}: failures not among its known failures structure" in err


def test_conformance_json_reports_known_new_and_no_longer_failing(known, capsys):
    known.write_text(known.read_text() + "offset@roundtrip  # listed, but SizeAsArray passes\n")
    args = ["conformance", MUTANT, "tqbatch", *BUDGET, "--json"]
    args += ["--known-failures", f"{MUTANT}={known}"]  # the mutant's list, not tqbatch's
    assert cli.main(args) == ExitCode.OK  # a listed failure not found does not fail the run
    out, err = capsys.readouterr()
    data = json.loads(out)  # stdout is the JSON alone
    assert data["exit_code"] == 0
    mutant, own = data["targets"]
    assert (mutant["target"], mutant["conforms"], mutant["passes"]) == (MUTANT, False, True)
    assert mutant["known"] == ["size_type"] and mutant["new"] == []
    assert mutant["fixed"] == ["offset@roundtrip"]
    [failure] = mutant["contract_failures"]
    assert failure["identity"] == "size_type" and failure["level"] == "contract"
    assert failure["what"].startswith("size() returned array") and failure["ops"]
    assert mutant["policy_differences"] == []
    assert own["impl"] == "tqbatch.cache:BatchTurboQuantKVCache" and own["conforms"]
    assert own["known_failures_files"] == [] and own["fixed"] == []
    # Progress and the judgement go to stderr, per target, as it runs.
    assert "surveying [1/2] tqbatch.testing.mutants:SizeAsArray" in err
    assert "surveying [2/2] tqbatch" in err
    assert "NO LONGER FAILS: offset@roundtrip is listed as a known failure" in err
    # Strict: a listed failure that was not found fails the run.
    assert cli.main([*args, "--strict-known-failures"]) == ExitCode.DEFECT
    assert "listed but not found offset@roundtrip" in capsys.readouterr().err


def test_written_known_failures_make_the_same_run_green(tmp_path, gate_targets, capsys):
    path = tmp_path / "lists" / "two.txt"
    args = ["conformance", TWO_DEFECTS, *BUDGET]
    assert cli.main([*args, "--write-known-failures", str(path)]) == ExitCode.DEFECT
    written = KnownFailures.load(path)
    assert set(written.entries) == {"size_type", "structure"}
    assert all(reason.startswith("unreviewed: ") for reason in written.entries.values())
    assert f"# Generated by: tqbatch conformance {TWO_DEFECTS} --examples 2" in path.read_text()
    assert cli.main([*args, "--known-failures", str(path)]) == ExitCode.OK
    many = ["conformance", TWO_DEFECTS, MUTANT, "--write-known-failures", str(path)]
    assert cli.main(many) == ExitCode.USAGE


def test_a_bad_known_failures_argument_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("size_type\n")
    assert cli.main(["conformance", MUTANT, "--known-failures", str(bad)]) == ExitCode.USAGE
    assert "bad.txt:1: 'size_type' has no reason" in capsys.readouterr().err
    other = ["conformance", MUTANT, "--known-failures", f"tqbatch={bad}"]
    assert cli.main(other) == ExitCode.USAGE
    assert "'tqbatch' is none of this run's targets" in capsys.readouterr().err
    missing = ["fuzz", "--impl", MUTANT, "--known-failures", str(tmp_path / "nope.txt")]
    assert cli.main(missing) == ExitCode.USAGE


# ---------------------------------------------------------------- fuzz


def test_fuzz_judges_its_survey_against_known_failures(tmp_path, known, gate_targets):
    args = ["fuzz", "--profile", "ci", *BUDGET, "--out", str(tmp_path / "failures")]
    assert cli.main([*args, "--impl", MUTANT]) == ExitCode.DEFECT
    assert cli.main([*args, "--impl", MUTANT, "--known-failures", str(known)]) == ExitCode.OK
    two = [*args, "--impl", TWO_DEFECTS, "--known-failures", str(known)]
    assert cli.main(two) == ExitCode.DEFECT


# ---------------------------------------------------------------- replay


def test_a_saved_failure_replays_against_the_target_it_was_found_on(tmp_path, capsys):
    out = tmp_path / "failures"
    fuzz = ["fuzz", "--impl", MUTANT, "--examples", "1", "--profile", "ci", "--out", str(out)]
    assert cli.main(fuzz) == ExitCode.DEFECT
    [saved] = out.glob("*.json")
    capsys.readouterr()
    assert cli.main(["replay", str(saved)]) == ExitCode.DEFECT  # no option: where it was found
    stdout = capsys.readouterr().out
    assert f"replaying against {MUTANT}: the target it was found on" in stdout
    assert f"FAIL {saved.stem} [{MUTANT}]" in stdout and "[size_type]" in stdout
    fixed = ["replay", "--impl", "tqbatch", "--oracles-only", str(saved)]
    assert cli.main(fixed) == ExitCode.OK
    # A recorded target that no longer loads: a usage error naming the file.
    doc = json.loads(saved.read_text())
    doc["found_on"]["options"]["impl"] = "gone.module:Cache"
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(doc))
    assert cli.main(["replay", str(moved)]) == ExitCode.USAGE
    assert f"({moved} was found on it; --impl replays it against another)" in (
        capsys.readouterr().err
    )


# ---------------------------------------------------------------- aliases


def test_every_command_takes_the_aliases(tmp_path, capsys):
    import mlx_vlm.turboquant

    assert load_impl("mlx-vlm") is mlx_vlm.turboquant.BatchTurboQuantKVCache
    # No merge or prepare in it: mlx-vlm's class runs it, and fails at once (it keeps an
    # `_idx` attribute beside packed keys): exit 1, where the alias once gave exit 2.
    scenario = str(golden.DIRECTORY / "05_padded_prefill_decode_at_written_end_omlx_2172.json")
    assert cli.main(["replay", "--impl", "mlx-vlm", scenario]) == ExitCode.DEFECT
    out = capsys.readouterr().out
    assert "FAIL 05_" in out and "[mlx_vlm.turboquant:BatchTurboQuantKVCache]" in out
    assert cli.main(["replay", "--impl", "tqbatch", scenario]) == ExitCode.OK
    fuzz = ["fuzz", "--impl", "mlx-vlm", "--examples", "1", "--profile", "ci"]
    assert cli.main([*fuzz, "--out", str(tmp_path / "f")]) == ExitCode.DEFECT


# ---------------------------------------------------------------- capabilities


def test_constructor_parameters_are_capabilities():
    import tqbatch

    assert all(capabilities(tqbatch.BatchTurboQuantKVCache).values())
    assert unsupported_configurations(tqbatch.BatchTurboQuantKVCache) == []
    split, seed = capabilities(WithoutSplitBits), capabilities(WithoutSeed)
    assert (split["split_bits"], split["seed"], seed["split_bits"], seed["seed"]) == (
        False,
        True,
        True,
        False,
    )
    assert unsupported_configurations(WithoutSplitBits) == ["split key/value bits"]
    assert unsupported_configurations(WithoutSeed) == ["a codec seed other than 0"]
    assert missing_capabilities(WithoutSplitBits) == []  # every op is there

    class TakesAnyKeyword(WithoutSeed):
        def __init__(self, left_padding, **kwargs):
            super().__init__(left_padding, **{k: v for k, v in kwargs.items() if k != "seed"})

    assert unsupported_configurations(TakesAnyKeyword) == []  # **kwargs takes them


def test_a_configuration_the_constructor_cannot_take_is_unsupported_not_run():
    new = {"op": "new", "left_padding": [0, 1]}
    # The broken case: drawn anyway, the constructor raises (once reported as a defect).
    with pytest.raises(TypeError, match="key_bits"):
        WithoutSplitBits([0], bits=4.0, key_bits=3.0)
    split = World(WithoutSplitBits, key_bits=3.0, value_bits=2.0)
    assert not split.supports(new)
    with pytest.raises(UnsupportedOp):
        split.apply(new)
    assert not World(WithoutSeed, seed=1).supports(new)
    assert not World(WithoutSeed).supports({**new, "seed": 2})
    # What it can take runs and checks clean.
    for world in (World(WithoutSplitBits, seed=2), World(WithoutSeed, key_bits=3.0)):
        world.apply(new)
        world.apply({"op": "update", "tokens": 3, "kv_seed": 1})
        world.check()
    # A scenario of a configuration it cannot take is skipped, as for a missing op.
    scenario = Scenario(name="split", description="-", ops=[new], config=_config(key_bits=3.0))
    assert replay(scenario, WithoutSplitBits, use_recording=False).skipped
    assert replay(scenario, WithoutSeed, use_recording=False).ok


def _config(**extra) -> dict:
    from tqbatch.testing.replay.scenario import DEFAULT_CONFIG

    return {**DEFAULT_CONFIG, **extra}


@given(tqs.configs({"split_bits": False, "seed": False}))
def test_configurations_a_constructor_cannot_take_are_not_drawn(config):
    assert "key_bits" not in config and "value_bits" not in config
    assert config["seed"] == 0


def test_bad_input_needing_another_seed_is_not_drawn_without_one():
    caps = capabilities(WithoutSeed)
    cases = [case for case, _ in bad_input_cases(2, 3, caps, 0)]
    assert "extend-mixed-config" not in cases and "merge-mixed-config" in cases
    full = [case for case, _ in bad_input_cases(2, 3, capabilities(WithoutSplitBits), 0)]
    assert "extend-mixed-config" in full


@pytest.mark.parametrize(
    ("double", "unsupported"),
    [(WithoutSplitBits, "split key/value bits"), (WithoutSeed, "a codec seed other than 0")],
)
def test_fuzz_lists_unsupported_configurations_not_failures(tmp_path, capsys, double, unsupported):
    args = ["fuzz", "--impl", f"tqbatch.testing.selfcheck.doubles:{double.__name__}", "--survey"]
    args += ["--examples", "3", "--profile", "ci", "--out", str(tmp_path / "failures")]
    assert cli.main(args) == ExitCode.OK
    out, err = capsys.readouterr()
    assert "no failures in" in out
    assert f"cannot take {unsupported}" in err and unsupported in out
    assert not (tmp_path / "failures").exists() or not any((tmp_path / "failures").iterdir())
