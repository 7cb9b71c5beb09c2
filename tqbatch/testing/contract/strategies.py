"""Hypothesis strategies for op sequences of the vocabulary in docs/ops.md.

Each strategy draws plain JSON-able dicts (or lists of them) sized for a
2-core CPU: at most ``MAX_ROWS`` rows, short prompts, blocks of a few tokens.
Strategies that depend on the current batch take its geometry as arguments;
they never look at a cache. A strategy for one op lives in that op's module
(``tqbatch.testing.contract.ops``); here: the configurations, sequences of several
ops (a batch's first ops, a prefill), and the bad-input catalogue, gathered
from every op's ``bad_inputs``.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from hypothesis import strategies as st

__all__ = [
    "MAX_ROWS",
    "MAX_PROMPT",
    "BatchShape",
    "configs",
    "seeds",
    "merge_op",  # noqa: F822 (module __getattr__)
    "left_padded_prefill_ops",
    "right_padded_prefill_ops",
    "first_batch_ops",
    "written_batch_ops",
    "other_batch_ops",
    "attend_op",  # noqa: F822 (module __getattr__)
    "filter_indices",  # noqa: F822 (module __getattr__)
    "bad_input_cases",
    "bad_input_op",
    "expect_error_op",
    "BAD_INPUT_ERRORS",  # noqa: F822 (module __getattr__)
    "POLICY_CASES",  # noqa: F822 (module __getattr__)
]

MAX_ROWS = 4
MAX_PROMPT = 10
MAX_BLOCK = 4

seeds = st.integers(0, 2**16)


def configs(capabilities: dict | None = None):
    """World configuration: bit widths, codec seed, K/V geometry.

    Cheap, common choices first (Hypothesis shrinks towards them); the head
    dims models use (96, 128, 256), 2.5, 6 and 8 bits and separate key /
    value widths after them. Per-side widths are integers: a fractional one
    depends on the data (mlx-vlm picks its high-precision channels from the
    first tokens), so tqbatch refuses it. Configurations the target's
    constructor cannot take (``capabilities``, ``tqbatch.testing.target``:
    ``split_bits``, ``seed``) are not drawn.
    """
    caps = capabilities or {}
    widths = [2.0, 3.0, 3.5, 4.0, 2.5, 6.0, 8.0]
    side = st.sampled_from([2.0, 3.0, 4.0, 6.0, 8.0])
    return st.fixed_dictionaries(
        {
            "bits": st.sampled_from(widths),
            "seed": st.integers(0, 2) if caps.get("seed", True) else st.just(0),
            "kv_heads": st.sampled_from([1, 2]),
            # 80 at 3 bits packs to a width that is not a whole number of
            # coordinates: codec rebuild from packed width fails there (omlx #577),
            # so it is drawn twice as often as the others.
            "head_dim": st.sampled_from([32, 64, 80, 80, 96, 128, 256]),
        },
        optional={"key_bits": side, "value_bits": side} if caps.get("split_bits", True) else {},
    )


@st.composite
def left_padded_prefill_ops(draw, max_rows: int = MAX_ROWS):
    """Constructor, prepare(left_padding), then a prefill covering the padding."""
    B = draw(st.integers(1, max_rows))
    base = draw(st.lists(st.integers(0, 2), min_size=B, max_size=B))
    extra = draw(st.lists(st.integers(0, 4), min_size=B, max_size=B))
    tokens = max(p + e for p, e in zip(base, extra)) + draw(st.integers(1, 3))
    return [
        {"op": "new", "left_padding": base},
        {"op": "prepare", "left_padding": extra, "right_padding": None},
        {"op": "update", "tokens": tokens, "kv_seed": draw(seeds)},
    ]


@st.composite
def right_padded_prefill_ops(draw, rows: int | None = None, max_rows: int = MAX_ROWS):
    """prepare(right_padding) + prefill + finalize, on a new batch (rows=None) or on ``rows``."""
    ops = []
    if rows is None:
        rows = draw(st.integers(1, max_rows))
        ops.append({"op": "new", "left_padding": [0] * rows})
    right = draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows))
    tokens = max(right) + draw(st.integers(1, 3))
    ops += [
        {"op": "prepare", "left_padding": None, "right_padding": right},
        {"op": "update", "tokens": tokens, "kv_seed": draw(seeds)},
        {"op": "finalize"},
    ]
    return ops


@st.composite
def b1_decoded_ops(draw):
    """A single request that decoded alone first (for late joins)."""
    ops = [{"op": "merge", "lengths": [draw(st.integers(1, MAX_PROMPT))], "kv_seed": draw(seeds)}]
    for _ in range(draw(st.integers(1, 3))):
        ops.append({"op": "update", "tokens": 1, "kv_seed": draw(seeds)})
    return ops


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
    options = [
        st.lists(st.integers(0, 3), min_size=1, max_size=max_rows).map(
            lambda lp: [{"op": "new", "left_padding": lp}]
        )
    ]
    if capabilities.get("merge"):
        from tqbatch.testing.contract.ops.merge import merge_op

        options += [merge_op(max_rows).map(lambda op: [op]), b1_decoded_ops()]
    else:
        # Without merge, an extend would otherwise join only empty batches:
        # two written batches of different lengths come from here.
        options.append(written_batch_ops(max_rows))
    if capabilities.get("prepare"):
        options.append(left_padded_prefill_ops(max_rows))
        if capabilities.get("finalize"):
            options.append(right_padded_prefill_ops(None, max_rows))
    return st.one_of(options)


def other_batch_ops(capabilities: dict, max_rows: int = 2):
    """The nested ops of an ``extend``: a second batch, possibly empty."""
    empty = st.lists(st.integers(0, 3), min_size=1, max_size=max_rows).map(
        lambda lp: [{"op": "new", "left_padding": lp}]
    )
    return st.one_of(empty, first_batch_ops(capabilities, max_rows))


class BatchShape(NamedTuple):
    """What a bad-input case may depend on: the batch's rows, its written end (0:
    nothing written yet), the target's capabilities, and the world's codec seed."""

    rows: int
    written: int
    capabilities: dict
    world_seed: int


def bad_input_cases(
    batch_size: int, written: int, capabilities: dict, world_seed: int
) -> list[tuple[str, dict]]:
    """Every bad-input ``(case, inner op)`` that applies to a batch of this geometry.

    The catalogue ``bad_input_op`` draws from, and that a test can walk case
    by case (tqbatch's pytest plugin does): each op's ``bad_inputs``
    (``tqbatch.testing.contract.ops``), for the ops whose capabilities the target
    offers (``capabilities``, ``tqbatch.testing.target``).
    """
    from tqbatch.testing.contract.ops import OPS

    batch = BatchShape(batch_size, written, capabilities, world_seed)
    choices = []
    for op in OPS.values():
        if not all(capabilities.get(c) for c in op.needs):
            continue
        for bad in op.bad_inputs:
            if bad.after_write and not written:
                continue
            inner = bad.inner(batch)
            if inner is not None:
                choices.append((bad.case, inner))
    return choices


def expect_error_op(case: str, inner: dict) -> dict:
    """The ``expect_error`` op of bad-input ``case``: ``inner`` must raise its documented error."""
    return {"op": "expect_error", "inner": inner, "error": _bad_input_errors()[case], "case": case}


@st.composite
def bad_input_op(
    draw, batch_size: int, written: int, capabilities: dict, world_seed: int, avoid=frozenset()
):
    """An ``expect_error`` op whose inner op the contract requires to be rejected.

    Each op names its ``case``: the identity a survey reports it under.
    Cases in ``avoid`` are not drawn (while any other is left).
    """
    choices = bad_input_cases(batch_size, written, capabilities, world_seed)
    choices = [c for c in choices if c[0] not in avoid] or choices
    # The op kind first, then the variant: every kind of bad input is equally
    # likely, however many variants it has (a flat draw under-samples kinds
    # listed late, such as extend with a mixed configuration).
    kinds = sorted({inner["op"] for _, inner in choices})
    kind = draw(st.sampled_from(kinds))
    case, inner = draw(st.sampled_from([c for c in choices if c[1]["op"] == kind]))
    return expect_error_op(case, inner)


def _bad_input_errors() -> dict[str, str]:
    """The exception each bad-input case must raise: tqbatch's policy (README, Errors).

    TypeError for a wrong kind of object, IndexError for an index past the
    batch, ValueError for everything else.
    """
    from tqbatch.testing.contract.ops import OPS

    return {bad.case: bad.error for op in OPS.values() for bad in op.bad_inputs}


# Strategies of one op, kept in its module; read from here too.
_OP_STRATEGIES = {
    "merge_op": "tqbatch.testing.contract.ops.merge",
    "attend_op": "tqbatch.testing.contract.ops.attend",
    "filter_indices": "tqbatch.testing.contract.ops.filter",
}


def __getattr__(name: str):
    # Gathered from the op modules, which import this one: read on first use.
    if name == "BAD_INPUT_ERRORS":
        return _bad_input_errors()
    if name == "POLICY_CASES":
        from tqbatch.testing.contract.ops import policy_cases

        return policy_cases()
    if name in _OP_STRATEGIES:
        return getattr(importlib.import_module(_OP_STRATEGIES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
