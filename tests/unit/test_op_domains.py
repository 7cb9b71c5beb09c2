"""Ops outside their domain are refused before the target sees them (``Op.validate``).

A correct cache rejects bad input, so an op that carries it at the top level
would blame the cache for the scenario's mistake; bad input is tested inside
``expect_error``. The minimizer relies on this: a cut that leaves such an op
(a ``filter`` whose rows were added by an op it dropped) is not a candidate.
"""

from __future__ import annotations

import pytest

from tqbatch import BatchTurboQuantKVCache
from tqbatch.testing.contract.observation import of_target
from tqbatch.testing.search.minimize import failure_of, minimize
from tqbatch.testing.world import World

H, D = 2, 64
JOIN_ONE_ROW = {
    "op": "extend",
    "other": [{"op": "new", "left_padding": [0]}, {"op": "update", "tokens": 2, "kv_seed": 3}],
}


def _two_rows() -> World:
    world = World(BatchTurboQuantKVCache, kv_heads=H, head_dim=D)
    world.apply({"op": "merge", "lengths": [2, 3], "kv_seed": 1})
    return world


@pytest.mark.parametrize(
    ("op", "why"),
    [
        ({"op": "filter", "indices": [2]}, "distinct rows of the 2"),
        ({"op": "filter", "indices": [1, 1]}, "distinct rows of the 2"),
        ({"op": "filter", "indices": []}, "one or more"),
        ({"op": "extract", "index": 2}, "not a row of the 2-row batch"),
        ({"op": "extract", "index": -1}, "not a row of the 2-row batch"),
        ({"op": "trim", "n": -1}, "n must be >= 0"),
        ({"op": "prepare", "left_padding": None, "right_padding": [1]}, "each of the 2 rows"),
        ({"op": "prepare", "left_padding": None, "right_padding": [1, -1]}, "each of the 2 rows"),
        ({"op": "prepare", "left_padding": [1, 0], "right_padding": None}, "after a write"),
        ({"op": "update", "tokens": 1, "kv_seed": 0, "rows": 3}, "the batch's"),
        ({"op": "update", "tokens": 1, "kv_seed": 0, "head_dim": 16}, "the batch's"),
        ({"op": "merge", "lengths": [2, 1], "kv_seed": 0, "foreign": True}, "refused"),
        ({"op": "merge", "lengths": [2, 1], "kv_seed": 0, "member_seeds": [0, 1]}, "mixed"),
        ({"op": "extend", "other": [{"op": "new", "left_padding": [0]}], "foreign": True},
         "refused"),
    ],
)  # fmt: skip
def test_an_op_outside_its_domain_is_refused_and_changes_nothing(op, why):
    world = _two_rows()
    before = of_target(world.target)
    with pytest.raises(ValueError, match=why) as raised:
        world.apply(op)
    assert "expect_error" in str(raised.value)
    assert world.ops[-1]["op"] == "merge"  # not recorded as applied
    after = of_target(world.target)
    assert before.keys() == after.keys()
    assert all((before[k] == after[k]).all() for k in before)


def test_the_same_ops_as_bad_input_still_reach_the_target():
    world = _two_rows()
    for inner, error in (
        ({"op": "filter", "indices": [2]}, "IndexError"),
        ({"op": "trim", "n": -1}, "ValueError"),
        ({"op": "prepare", "left_padding": [1, 0], "right_padding": None}, "ValueError"),
    ):
        assert world.apply({"op": "expect_error", "inner": inner, "error": error}) == error
        world.check()


def test_left_padding_before_the_prefill_is_in_the_domain():
    world = World(BatchTurboQuantKVCache, kv_heads=H, head_dim=D)
    world.apply({"op": "new", "left_padding": [0, 2]})
    world.apply({"op": "prepare", "left_padding": [1, 0], "right_padding": None})
    world.apply({"op": "update", "tokens": 4, "kv_seed": 1})
    world.check()


class FilterRefusesLaterRows(BatchTurboQuantKVCache):
    """Refuses to keep any row but the first, rows that exist included."""

    def filter(self, batch_indices):
        if any(int(i) > 0 for i in batch_indices):
            raise IndexError("row out of range")
        return super().filter(batch_indices)


def test_the_minimizer_keeps_the_op_that_put_the_row_there():
    """Dropping the extend would leave ``filter [1]`` on a one-row batch: the same
    ``raises@filter`` on this cache, and on a correct one too."""
    config = dict(kv_heads=H, head_dim=D)
    ops = [{"op": "merge", "lengths": [2], "kv_seed": 1}, JOIN_ONE_ROW,
           {"op": "filter", "indices": [1]}]  # fmt: skip
    shrunk, failure = minimize(FilterRefusesLaterRows, config, ops, "raises@filter")
    assert failure is not None and failure.identity == "raises@filter"
    assert shrunk == ops
    assert failure_of(BatchTurboQuantKVCache, config, shrunk, "raises@filter") is None
