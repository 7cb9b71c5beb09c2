"""Strategies for a batch's first ops, drawn from several op modules: ``new``, ``merge``,
``prepare`` and ``update`` (not an op: ``SHARED`` of ``tqbatch.testing.contract.ops``).

The state machine starts every example with ``first_batch_ops``; ``extend``
and ``prepare`` draw the other batch of an extend with ``other_batch_ops``.
"""

from __future__ import annotations

import functools

from hypothesis import strategies as st

from tqbatch.testing.contract.ops.merge import merge_op
from tqbatch.testing.contract.strategies import (
    MAX_PROMPT,
    MAX_ROWS,
    left_padded_prefill_ops,
    right_padded_prefill_ops,
    seeds,
)

__all__ = ["b1_decoded_ops", "first_batch_ops", "other_batch_ops", "written_batch_ops"]


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
@st.composite
def b1_decoded_ops(draw):
    """A single request that decoded alone first (for late joins)."""
    ops = [{"op": "merge", "lengths": [draw(st.integers(1, MAX_PROMPT))], "kv_seed": draw(seeds)}]
    for _ in range(draw(st.integers(1, 3))):
        ops.append({"op": "update", "tokens": 1, "kv_seed": draw(seeds)})
    return ops


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
@st.composite
def written_batch_ops(draw, max_rows: int = MAX_ROWS):
    """Constructor with left padding, then a prefill covering it: a written batch built the
    way a target without ``merge`` builds one (mlx-vlm's batch generator does)."""
    left_padding = draw(st.lists(st.integers(0, 3), min_size=1, max_size=max_rows))
    tokens = max(left_padding) + draw(st.integers(1, MAX_PROMPT))
    return [
        {"op": "new", "left_padding": left_padding},
        {"op": "update", "tokens": tokens, "kv_seed": draw(seeds)},
    ]


def first_batch_ops(capabilities: dict, max_rows: int = MAX_ROWS):
    """Ops that create a batch, using only what the target supports."""
    return _first_batch_ops(*_builds(capabilities), max_rows)


def other_batch_ops(capabilities: dict, max_rows: int = 2):
    """The nested ops of an ``extend``: a second batch, possibly empty."""
    return _other_batch_ops(*_builds(capabilities), max_rows)


def _builds(capabilities: dict) -> tuple[bool, bool, bool]:
    """What of the target's capabilities decides how a batch may be built."""
    return tuple(bool(capabilities.get(name)) for name in ("merge", "prepare", "finalize"))


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
def _first_batch_ops(merge: bool, prepare: bool, finalize: bool, max_rows: int):
    options = [
        st.lists(st.integers(0, 3), min_size=1, max_size=max_rows).map(
            lambda lp: [{"op": "new", "left_padding": lp}]
        )
    ]
    if merge:
        options += [merge_op(max_rows).map(lambda op: [op]), b1_decoded_ops()]
    else:
        # Without merge, an extend would otherwise join only empty batches:
        # two written batches of different lengths come from here.
        options.append(written_batch_ops(max_rows))
    if prepare:
        options.append(left_padded_prefill_ops(max_rows))
        if finalize:
            options.append(right_padded_prefill_ops(None, max_rows))
    return st.one_of(options)


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
def _other_batch_ops(merge: bool, prepare: bool, finalize: bool, max_rows: int):
    empty = st.lists(st.integers(0, 3), min_size=1, max_size=max_rows).map(
        lambda lp: [{"op": "new", "left_padding": lp}]
    )
    return st.one_of(empty, _first_batch_ops(merge, prepare, finalize, max_rows))
