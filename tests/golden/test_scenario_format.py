"""The scenario machinery itself: recording, staleness, comparison, pinning failures, CLI."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from tqbatch.cli import main
from tqbatch.testing.mutants import MUTANTS
from tqbatch.testing.replay import replayer
from tqbatch.testing.replay.golden import DIRECTORY as GOLDEN
from tqbatch.testing.replay.recorder import RecordError, record
from tqbatch.testing.replay.replayer import replay
from tqbatch.testing.replay.scenario import Scenario, ScenarioError, platform_id, write_failure

SMALL = "16_size_is_written_end_int_at_batch"
FILTER = "03_filter_zero_padding_row_one_survivor_omlx_2172"


def _copy(name: str, directory: Path) -> Path:
    for suffix in (".json", ".npz"):
        shutil.copy(GOLDEN / f"{name}{suffix}", directory / f"{name}{suffix}")
    return directory / f"{name}.json"


def test_write_failure_pins_a_failing_sequence(tmp_path):
    """A sequence that kills a mutant becomes a scenario that reproduces it in one call."""
    ops = Scenario.load(GOLDEN / f"{FILTER}.json").ops
    path = write_failure(ops, {"head_dim": 64}, tmp_path, error="left_padding is [4, 3]\n...")
    scenario = Scenario.load(path)
    assert scenario.ops == ops and scenario.recording is None
    assert "left_padding is [4, 3]" in scenario.description
    bad = replay(path, MUTANTS["FilterWithoutCompaction"], use_recording=False)
    assert not bad.ok and bad.divergences[0].quantity == "left_padding"
    assert replay(path, use_recording=False).ok
    # Without a recording a plain replay says so instead of passing, and
    # still reproduces the failure against the oracles.
    unrecorded = replay(path)
    assert not unrecorded.ok and "not recorded" in unrecorded.summary()
    reproduced = replay(path, MUTANTS["FilterWithoutCompaction"])
    assert [d.quantity for d in reproduced.divergences] == ["recording", "left_padding"]
    assert main(["replay", str(path)]) == 1
    assert main(["replay", "--oracles-only", str(path)]) == 0
    # Once fixed, one command records it.
    assert main(["record", str(path)]) == 0
    assert replay(path).ok


def test_record_refuses_a_divergent_target_and_writes_nothing(tmp_path):
    path = _copy(FILTER, tmp_path)
    path.with_suffix(".npz").unlink()
    before = path.read_text()
    with pytest.raises(RecordError, match="refusing to record"):
        record(path, MUTANTS["FilterWithoutCompaction"])
    assert not path.with_suffix(".npz").exists()
    assert path.read_text() == before


def test_edited_ops_make_the_recording_stale(tmp_path):
    path = _copy(SMALL, tmp_path)
    doc = json.loads(path.read_text())
    doc["ops"][1]["kv_seed"] += 1
    path.write_text(json.dumps(doc))
    result = replay(path)
    assert not result.ok and "stale" in result.summary()
    assert main(["record", str(path)]) == 0  # only stale ones are re-recorded
    assert replay(path).ok


def _recorded_here(name: str, directory: Path) -> Path:
    """A copy of a golden scenario recorded on this platform, where replays are bit-exact
    (the shipped recordings were made on the CPU; elsewhere cross-platform tolerances apply)."""
    path = _copy(name, directory)
    record(path)
    return path


def _tamper(path: Path, key_part: str, change) -> str:
    npz = path.with_suffix(".npz")
    with np.load(npz) as f:
        data = {k: f[k] for k in f.files}
    key = next(k for k in sorted(data) if key_part in k)
    data[key] = change(data[key].copy())
    np.savez_compressed(npz, **data)
    return key


def test_one_flipped_packed_bit_is_a_divergence(tmp_path):
    """Bit-exactness is real: one bit of one recorded packed word fails the replay."""
    path = _recorded_here(SMALL, tmp_path)

    def flip(a):
        a[0, 0, -1, 0] ^= 1  # row 0's newest token: never padding
        return a

    key = _tamper(path, "state.keys.indices", flip)
    result = replay(path)
    assert not result.ok
    assert result.divergences[0].quantity == "state" and key.split(".", 1)[1] in str(
        result.divergences[0]
    )


def test_padding_slots_are_not_compared(tmp_path):
    """What an implementation keeps in padding slots is unspecified."""
    path = _copy(FILTER, tmp_path)

    def scribble(a):
        a[0, :, 0] = 7  # merge lengths [3, 7, 2]: row 0 has 4 padding slots
        return a

    _tamper(path, "000.state.keys.indices", scribble)
    assert replay(path).ok


def test_cross_platform_tolerances_apply_off_the_recording_platform(tmp_path, monkeypatch):
    """A flipped bucket passes across platforms but not on the same one; a shift fails both."""
    path = _recorded_here(SMALL, tmp_path)

    def flip(a):
        a[0, 0, -1, 0] ^= 1
        return a

    _tamper(path, "000.state.keys.indices", flip)
    assert not replay(path).ok
    here = platform_id()  # another device and OS, at the same matmul precision
    monkeypatch.setattr(
        replayer, "platform_id", lambda: {**here, "device": "gpu", "system": "Darwin"}
    )
    crossed = replay(path)
    assert crossed.ok and crossed.cross_platform, crossed.summary()

    def shift(a):
        return np.roll(a, 1, axis=2)  # every token one slot late: a geometry bug

    _tamper(path, "001.state.values.indices", shift)
    assert not replay(path).ok


def test_at_another_precision_only_exact_quantities_meet_the_recording(tmp_path, monkeypatch):
    """A recording replayed at another matmul precision (float32 recordings at TF32):
    attention moved past any fixed table bound is left to the oracles, which bound it
    at that precision; an integer quantity still meets the recording exactly."""
    path = _recorded_here(SMALL, tmp_path)
    _tamper(path, "004.attention", lambda a: a + 1e-2)  # 10x the cross-platform atol
    assert not replay(path).ok
    here = platform_id()
    other = "float32" if here["precision"] == "tf32" else "tf32"
    monkeypatch.setattr(replayer, "platform_id", lambda: {**here, "precision": other})
    result = replay(path)
    assert result.ok and result.other_precision == here["precision"], result.summary()
    assert "by the oracles only" in result.summary()
    _tamper(path, "002.offset", lambda a: a + 1)
    result = replay(path)
    assert not result.ok and result.divergences[0].quantity == "offset", result.summary()


def test_compare_reports_what_differs():
    tol = {"atol": 1e-5, "rtol": 0, "max_mismatch_fraction": 0}
    want = np.zeros((2, 3), dtype=np.float32)
    assert replayer._compare("attention", want + 1e-6, want, tol, None) is None
    assert "outside" in replayer._compare("attention", want + 1e-3, want, tol, None)
    assert "shape" in replayer._compare("attention", want[:1], want, tol, None)
    nan = want.copy()
    nan[0] = np.nan  # unrecorded (padding query): ignored
    poked = (want + 7 * np.isnan(nan)).astype(np.float32)
    assert replayer._compare("attention", poked, nan, tol, None) is None
    assert "NaN" in replayer._compare("attention", nan[::-1].copy(), nan, tol, None)


def test_malformed_scenarios_are_rejected(tmp_path):
    path = _copy(SMALL, tmp_path)
    doc = json.loads(path.read_text())
    doc["tolerances"]["mask"]["reason"] = ""
    path.write_text(json.dumps(doc))
    with pytest.raises(ScenarioError, match="reason"):
        Scenario.load(path)
    doc["tolerances"]["mask"]["reason"] = "booleans"
    doc["config"]["dtype"] = "bfloat16"
    path.write_text(json.dumps(doc))
    with pytest.raises(ScenarioError, match="float32"):
        Scenario.load(path)
    assert main(["replay", str(path)]) == 2
    assert main(["replay", str(tmp_path / "missing.json")]) == 2


def test_replay_cli_exit_codes(tmp_path, capsys):
    path = _copy(SMALL, tmp_path)
    assert main(["replay", str(path)]) == 0
    mutant = "tqbatch.testing.mutants:SizeAsArray"
    assert main(["replay", "--impl", mutant, str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "not an int" in out
    assert main(["replay", "--impl", "nowhere:Nothing", str(path)]) == 2


def test_recording_twice_gives_identical_bytes(tmp_path, monkeypatch):
    """Re-recording unchanged observations must not change the file (no git noise)."""
    path = _copy(SMALL, tmp_path)
    npz = path.with_suffix(".npz")
    now = time.time()
    # An hour apart: a writer that stamps members with the clock would differ.
    monkeypatch.setattr(time, "time", lambda: now)
    record(path)
    first = npz.read_bytes()
    monkeypatch.setattr(time, "time", lambda: now + 3600)
    record(path)
    assert npz.read_bytes() == first
    with np.load(npz) as recorded, np.load(GOLDEN / f"{SMALL}.npz") as shipped:
        assert sorted(recorded.files) == sorted(shipped.files)
        # The same bits as the shipped recording where it was made (the CPU); on
        # another platform (an H200: float32 GPU rounding) only the same names.
        if Scenario.load(GOLDEN / f"{SMALL}.json").recording["platform"] == platform_id():
            assert all(np.array_equal(recorded[k], shipped[k]) for k in shipped.files)


def test_failures_of_two_targets_on_the_same_ops_get_two_files(tmp_path):
    """A survey of several caches into one directory must not overwrite a repro."""
    ops = Scenario.load(GOLDEN / f"{FILTER}.json").ops
    paths = {
        write_failure(ops, {}, tmp_path, options={"impl": impl})
        for impl in ("tqbatch.testing.mutants:FilterWithoutCompaction", "mypkg.cache:MyCache")
    }
    assert len(paths) == 2 and all(p.exists() for p in paths)
    assert {p.stem.split("_")[1] for p in paths} == {"filterwithoutcompaction", "mycache"}
    assert write_failure(ops, {}, tmp_path).stem.startswith("failure_")  # no target given
