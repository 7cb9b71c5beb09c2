"""Replay every golden scenario against the target; show that they kill their mutants.

The scenarios are package data (``tqbatch/testing/replay/golden``), so that an
installed tqbatch replays them too.

The target is ``--impl`` / ``$TQBATCH_IMPL`` (default tqbatch's class). Nothing
here records: a missing or stale recording fails, naming ``tqbatch record``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tqbatch.testing.mutants import MUTANTS, SEED_DEFECTS
from tqbatch.testing.replay.golden import DIRECTORY as GOLDEN
from tqbatch.testing.replay.replayer import replay
from tqbatch.testing.replay.scenario import Scenario, discover, platform_id
from tqbatch.testing.target import load_impl

SCENARIOS = [Scenario.load(p) for p in discover([GOLDEN])]
BY_NAME = {s.name: s for s in SCENARIOS}

# The historical bugs (the seed's comments and omlx / mlx-vlm reports): each item
# and the scenario(s) that pin it.
HISTORICAL_BUGS = {
    "1 masks of left-padded rows (omlx PR #1547)": ["01_left_padded_masks_omlx_pr1547"],
    "2 make_mask at B > 1 with return_array and window_size (omlx PR #717)": [
        "02_make_mask_batch_window_omlx_pr717"
    ],
    "3 filter away the zero-padding row, then decode (omlx #2172)": [
        "03_filter_zero_padding_row_one_survivor_omlx_2172",
        "04_filter_zero_padding_row_several_survivors_omlx_2172",
    ],
    "4 filter compaction in lockstep with a dense layer (omlx #2237)": [
        "06_filter_mask_width_matches_dense_layer_omlx_2237"
    ],
    "5 state at the written end after an append past 256": [
        "07_state_written_end_after_256_growth"
    ],
    "6 extend after one side grew past its capacity": ["08_extend_after_capacity_growth"],
    "7 a late join after B = 1 decode": ["09_late_join_after_batch_one_decode"],
    "8 a state restore that left the written end stale": ["10_restore_leaves_written_end_stale"],
    "9 merge and extend with mixed (bits, seed) (omlx #2045)": [
        "11_mixed_bits_seed_rejected_omlx_2045"
    ],
    "10 empty members in merge; an empty side in extend": [
        "12_empty_members_and_empty_extend_sides"
    ],
    "11 a foreign cache type in extend or merge (omlx #422)": [
        "13_foreign_cache_type_rejected_omlx_422"
    ],
    "12 restore: codec rebuild for D = 64, 80, 96, 128 at bits 3.5 and 4 (omlx #577)": [
        f"14_restore_codec_rebuild_d{d}_bits{b}_omlx_577"
        for d in (64, 80, 96, 128)
        for b in ("3p5", "4")
    ],
    "13 trim at B > 1 after a verify block, and after a filter to one row (omlx #3767)": [
        "15_trim_batch_after_verify_block_omlx_3767"
    ],
    "14 size() at B > 1": ["16_size_is_written_end_int_at_batch"],
    "15 prepare(right_padding) + finalize as an exact roll (omlx PR #3127); filter while "
    "right padding is pending": [
        "17_right_padding_finalize_exact_roll_omlx_pr3127",
        "18_filter_while_right_padding_pending",
    ],
    "16 B = 1 with left padding": ["19_batch_one_left_padding", "20_batch_one_right_padding"],
    "17 no _idx attribute": ["21_no_idx_attribute"],
    "18 a long lifecycle": ["22_long_lifecycle"],
}

KILLS = sorted((s.name, m) for s in SCENARIOS for m in s.kills)


@pytest.fixture(scope="module")
def target():
    return load_impl()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_scenario_replays_green(scenario, target):
    result = replay(scenario, target)
    if result.skipped:
        pytest.skip(result.skipped)
    assert result.ok, result.summary()
    assert result.compared_with_recording


@pytest.mark.parametrize(("name", "mutant"), KILLS, ids=[f"{m}-{n[:2]}" for n, m in KILLS])
def test_scenario_kills_the_mutant_it_pins(name, mutant):
    result = replay(BY_NAME[name], MUTANTS[mutant])
    assert result.skipped is None
    assert not result.ok, f"{name} replays green against the mutant {mutant}"
    # It must fail on the bug, not on bookkeeping of the recording itself.
    assert all(d.step >= 0 for d in result.divergences), result.summary()


def test_every_mutant_is_killed_by_a_named_scenario():
    killed = {m for _, m in KILLS}
    assert killed == set(MUTANTS), f"no scenario names {sorted(set(MUTANTS) - killed)}"
    assert set(SEED_DEFECTS) <= killed


def test_every_historical_bug_is_pinned():
    missing = {
        item: [n for n in names if n not in BY_NAME] for item, names in HISTORICAL_BUGS.items()
    }
    assert not {k: v for k, v in missing.items() if v}
    assert len(HISTORICAL_BUGS) == 18


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_scenario_document_is_complete(scenario):
    assert scenario.path.stem == scenario.name
    assert len(scenario.description) > 80 and "Pins" in scenario.description
    assert scenario.upstream, "name the upstream reference"
    assert set(scenario.kills) <= set(MUTANTS)
    for quantity, tol in scenario.tolerances.items():
        assert tol.get("reason"), quantity
        if "cross_platform" in tol:
            assert tol["cross_platform"].get("reason"), quantity
    assert scenario.recording is not None, "run `tqbatch record` on it"
    assert scenario.recording["digest"] == scenario.digest(), "stale: run `tqbatch record`"
    assert scenario.npz_path.exists()


# Scenarios whose packed state goes through every reshaping path: finalize's
# roll, growth past 256, a codec rebuild at D = 80, a long lifecycle.
CROSS_PROCESS = [
    "17_right_padding_finalize_exact_roll_omlx_pr3127",
    "07_state_written_end_after_256_growth",
    "14_restore_codec_rebuild_d80_bits3p5_omlx_577",
    "22_long_lifecycle",
]


def test_replay_is_bit_exact_across_processes(tmp_path):
    """A replay in a fresh process observes byte-identical state, extracts and outputs.

    Compared three ways: that process against this one, and both against the
    recording (made by yet another process, ``tqbatch record``) where it was
    made on this platform: bits are only promised within one device and
    matmul precision (``platform_id``); elsewhere replay's cross-platform
    tolerances apply (test_scenario_replays_green).
    """
    paths = [str(BY_NAME[n].path) for n in CROSS_PROCESS]
    env = dict(os.environ, TQBATCH_IMPL="tqbatch:BatchTurboQuantKVCache")
    proc = subprocess.run(
        [sys.executable, "-m", "tqbatch", "replay", "--save-observed", str(tmp_path), *paths],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    impl = load_impl("tqbatch:BatchTurboQuantKVCache")
    for name in CROSS_PROCESS:
        here = replay(BY_NAME[name], impl).observed
        with np.load(tmp_path / f"{name}.observed.npz") as npz:
            there = {k: npz[k] for k in npz.files}
        with np.load(BY_NAME[name].npz_path) as npz:
            recorded = {k: npz[k] for k in npz.files}
        if BY_NAME[name].recording["platform"] != platform_id():
            recorded = there
        assert here.keys() == there.keys() == recorded.keys()
        packed = [k for k in here if ".state." in k or ".extract_state." in k]
        assert packed, name
        for key in here:
            a, b, c = here[key], there[key], recorded[key]
            assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape, key
            # NaN marks unrecorded padding queries: compare bytes, NaN included.
            assert a.tobytes() == b.tobytes() == c.tobytes(), f"{name}: {key} differs"
