"""Golden scenarios against a cache without ``merge``: its batches built by constructor + prefill.

tqbatch's own cache with ``merge`` hidden takes the construction a cache
shaped like mlx-vlm's gets (``tqbatch.testing.contract.ops.merge``). It must replay
every golden it can run green against the same recordings, observe exactly
what the merge construction observes, and still fail where the cache is
broken: a constructor that ignores ``left_padding``, and the catalogued
mutants, each against the scenarios that pin it.
"""

from __future__ import annotations

import numpy as np
import pytest

from tqbatch import BatchTurboQuantKVCache
from tqbatch.cli import main
from tqbatch.testing.contract.ops.merge import BY_MERGE, BY_PREFILL, merge_only
from tqbatch.testing.gate.known_failures import KnownFailures, shipped
from tqbatch.testing.mutants import MUTANTS
from tqbatch.testing.replay.golden import DIRECTORY as GOLDEN
from tqbatch.testing.replay.replayer import replay
from tqbatch.testing.replay.scenario import Scenario, discover
from tqbatch.testing.target import capabilities, load_impl
from tqbatch.testing.world import nested_ops

SCENARIOS = [Scenario.load(p) for p in discover([GOLDEN])]
BY_NAME = {s.name: s for s in SCENARIOS}


def without_merge(cls: type) -> type:
    """``cls`` as a target without ``merge`` sees it (``capabilities``: no merge)."""
    return type(f"{cls.__name__}WithoutMerge", (cls,), {"merge": None, "__module__": __name__})


WithoutMerge = without_merge(BatchTurboQuantKVCache)


class IgnoresLeftPadding(WithoutMerge):
    """Built with no left padding whatever it is given: padded rows' offsets are too large."""

    def __init__(self, left_padding, *args, **kwargs):
        super().__init__([0] * len(left_padding), *args, **kwargs)


def _merges(scenario: Scenario) -> list[dict]:
    return [o for op in scenario.ops for o in nested_ops(op) if o["op"] == "merge"]


def _merge_only(scenario: Scenario) -> list[str]:
    return [why for why in map(merge_only, _merges(scenario)) if why]


MERGING = [s for s in SCENARIOS if _merges(s) and not _merge_only(s)]


def _request_slots(key: str, array: np.ndarray, observed: dict) -> np.ndarray:
    """A packed state leaf without its padding slots (their content is unspecified)."""
    if ".state." not in key or array.ndim < 3:
        return array
    left_padding = observed[key.split(".", 1)[0] + ".left_padding"]
    valid = np.arange(array.shape[2])[None, :] >= left_padding[:, None]
    return np.moveaxis(array, 2, 1)[valid]


def test_the_hidden_merge_is_hidden():
    assert not capabilities(WithoutMerge)["merge"]
    assert capabilities(BatchTurboQuantKVCache)["merge"]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_every_golden_replays_green_without_merge(scenario):
    result = replay(scenario, WithoutMerge)
    if _merge_only(scenario):
        assert result.skipped and "it has no merge, and" in result.skipped, result.summary()
        assert all(why in result.skipped for why in _merge_only(scenario))
        return
    assert result.ok, result.summary()
    assert result.compared_with_recording
    assert result.construction == (BY_PREFILL if _merges(scenario) else None)
    if result.construction:
        assert BY_PREFILL in result.summary()


@pytest.mark.parametrize("scenario", MERGING, ids=lambda s: s.name)
def test_the_prefill_construction_observes_what_merge_does(scenario):
    """Every step's geometry, masks, request slots, attention and extracted rows, bit for bit."""
    merged, prefilled = replay(scenario, BatchTurboQuantKVCache), replay(scenario, WithoutMerge)
    assert (merged.construction, prefilled.construction) == (BY_MERGE, BY_PREFILL)
    assert merged.ok and prefilled.ok, prefilled.summary()
    assert merged.observed.keys() == prefilled.observed.keys()
    for key, want in merged.observed.items():
        got = prefilled.observed[key]
        assert got.shape == want.shape and got.dtype == want.dtype, key
        got = _request_slots(key, got, merged.observed)
        want = _request_slots(key, want, merged.observed)
        assert np.array_equal(got, want, equal_nan=True), key


def test_a_constructor_that_ignores_left_padding_fails_at_the_first_op():
    result = replay(BY_NAME["01_left_padded_masks_omlx_pr1547"], IgnoresLeftPadding)
    assert result.construction == BY_PREFILL
    assert not result.ok and result.divergences[0].step == 0, result.summary()
    assert result.divergences[0].quantity in ("offset", "left_padding"), result.summary()


MUTANT_KILLS = sorted(
    (s.name, m)
    for s in MERGING
    for m in s.kills
    # A mutant of merge itself cannot show where merge is not called.
    if "merge" not in vars(MUTANTS[m])
)


@pytest.mark.parametrize(
    ("name", "mutant"), MUTANT_KILLS, ids=[f"{m}-{n[:2]}" for n, m in MUTANT_KILLS]
)
def test_a_scenario_still_kills_its_mutant_without_merge(name, mutant):
    result = replay(BY_NAME[name], without_merge(MUTANTS[mutant]))
    assert result.construction == BY_PREFILL
    assert not result.ok and result.skipped is None, result.summary()
    assert all(d.step >= 0 for d in result.divergences), result.summary()


def test_mlx_vlms_class_runs_past_its_listed_failures_against_the_recording():
    """Its tolerated ``structure`` (has ``_idx``) and ``size`` are left to their checks:
    the recording of ``has_idx`` and ``size`` would end the replay at its first op."""
    scenario = BY_NAME["01_left_padded_masks_omlx_pr1547"]
    listed = sorted(KnownFailures.load(shipped("mlx_vlm_0_7_10")).entries)
    plain = replay(scenario, load_impl("mlx-vlm"))
    assert not plain.ok and plain.divergences[0].step == 0
    scenario.found_on = {"tolerated": listed}
    try:
        result = replay(scenario, load_impl("mlx-vlm"))
    finally:
        scenario.found_on = None
    assert result.ok and result.compared_with_recording, result.summary()
    assert result.construction == BY_PREFILL
    assert {"size", "structure"} <= set(result.tolerated)


def test_tqbatch_replay_prints_the_construction(capsys):
    path = GOLDEN / "16_size_is_written_end_int_at_batch.json"
    assert main(["replay", "--impl", f"{__name__}:WithoutMerge", str(path)]) == 0
    assert f"batches built by {BY_PREFILL}" in capsys.readouterr().out
    assert main(["replay", str(path)]) == 0
    assert f"batches built by {BY_MERGE}" in capsys.readouterr().out
