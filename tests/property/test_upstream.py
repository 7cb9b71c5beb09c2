"""Divergences of mlx-vlm 0.7.10's own BatchTurboQuantKVCache, found by the state machine.

Each test replays the minimal op sequence of one finding through the harness
(docs/ops.md vocabulary) and is expected to fail with exactly that divergence
(``KnownDivergence``). ``strict=True``: once upstream fixes a bug, its test
XPASSes and the suite fails, so the fix gets noticed and the finding can go.

Upstream has no ``size()`` (it inherits ``_BaseCache.size``, always 0), which
every geometry check trips over first. To isolate the other findings they run
against ``UpstreamSized``, upstream plus only ``size() -> _idx``.
"""

import re

import pytest
from mlx_vlm.turboquant import BatchTurboQuantKVCache as Upstream

from tqbatch.testing.world import World

pytestmark = pytest.mark.upstream


class UpstreamSized(Upstream):
    """Upstream with ``size()`` reporting its written end (finding 1 patched out)."""

    def size(self):
        return self._idx


class KnownDivergence(Exception):
    """The run failed with the divergence the finding describes."""


def replay(impl, ops, expected: str, *, contract_checks=False):
    world = World(impl, bits=4.0, seed=0, kv_heads=1, head_dim=64, contract_checks=contract_checks)
    try:
        for op in ops:
            world.apply(op)
            world.check()
    except Exception as exc:  # noqa: BLE001 - classify, then re-raise
        if re.search(expected, f"{type(exc).__name__}: {exc}"):
            raise KnownDivergence(str(exc)) from exc
        raise


NEW1 = {"op": "new", "left_padding": [0]}
PREFILL = [{"op": "new", "left_padding": [0, 1]}, {"op": "update", "tokens": 3, "kv_seed": 1}]


def known(reason):
    return pytest.mark.xfail(strict=True, raises=KnownDivergence, reason=reason)


@known("size() is always 0: BatchTurboQuantKVCache does not override _BaseCache.size")
def test_size_is_the_written_end():
    replay(Upstream, [NEW1, {"op": "update", "tokens": 3, "kv_seed": 1}], r"size is 0")


@known("has `_idx` with packed keys: mlx-vlm's rollback treats it as a dense KVCache")
def test_no_idx_attribute():
    replay(Upstream, [NEW1], r"`_idx` attribute", contract_checks=True)


@known("extend with an empty batch keeps only this side's key rows (the next write then crashes)")
def test_extend_with_empty_other():
    # dequantize() shows the lost rows at the extend itself, before the write
    # that used to be the first to fail ("Cannot broadcast").
    ops = [
        NEW1,
        {"op": "update", "tokens": 2, "kv_seed": 1},
        {"op": "extend", "other": [NEW1]},
    ]
    replay(UpstreamSized, ops, r"dequantize\(\) keys have 1 rows .* the batch 2")


@known("extend of an empty batch does not adopt the other side's codecs")
def test_extend_empty_self():
    ops = [
        NEW1,
        {"op": "extend", "other": [NEW1, {"op": "update", "tokens": 2, "kv_seed": 2}]},
        {"op": "update", "tokens": 1, "kv_seed": 3},
    ]
    replay(UpstreamSized, ops, r"'NoneType' object has no attribute")


@known("state hands out the live offset array, which update_and_fetch mutates in place")
def test_restored_copy_shares_no_array():
    replay(UpstreamSized, PREFILL + [{"op": "roundtrip"}], r"offset is \[4, 3\]")


@known("a state/meta_state restore into a fresh instance has no codecs")
def test_restore_rebuilds_codecs():
    ops = [NEW1, {"op": "roundtrip"}, {"op": "update", "tokens": 2, "kv_seed": 1}]
    replay(UpstreamSized, ops, r"no attribute 'key_codec'")


BAD_INPUT = {
    # MLX gathers do not bounds-check: out-of-range rows come back as garbage.
    "filter_out_of_range": ({"op": "filter", "indices": [5]}, "IndexError"),
    "filter_duplicates": ({"op": "filter", "indices": [0, 0]}, "ValueError"),
    "extract_out_of_range": ({"op": "extract", "index": 5}, "IndexError"),
    "trim_negative": ({"op": "trim", "n": -1}, "ValueError"),
    "extend_mixed_seed": (
        {
            "op": "extend",
            "other": [
                {"op": "new", "left_padding": [0], "seed": 1},
                {"op": "update", "tokens": 2, "kv_seed": 1},
            ],
        },
        "ValueError",
    ),
    "extend_foreign_type": (
        {"op": "extend", "other": [NEW1], "foreign": True},
        "TypeError",
    ),
}


@known("bad input is accepted silently instead of raising a typed error")
@pytest.mark.parametrize("inner,error", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_rejected(inner, error):
    ops = PREFILL + [{"op": "expect_error", "inner": inner, "error": error}]
    replay(UpstreamSized, ops, r"the target accepted the op")


def test_upstream_geometry_otherwise_in_lockstep():
    """What upstream gets right (with size() patched): a lifecycle without the findings."""
    ops = PREFILL + [
        {"op": "attend", "queries": 2, "q_heads": 2, "q_seed": 2, "window_size": 2},
        {"op": "extend", "other": [NEW1, {"op": "update", "tokens": 5, "kv_seed": 3}]},
        {"op": "attend", "queries": 1, "q_heads": 2, "q_seed": 4},
        {"op": "filter", "indices": [2, 1]},
        {"op": "trim", "n": 1},
        {"op": "extract", "index": 1},
        {"op": "attend", "queries": 1, "q_heads": 1, "q_seed": 5},
    ]
    replay(UpstreamSized, ops, r"^$")
