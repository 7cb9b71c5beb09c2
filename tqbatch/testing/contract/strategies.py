"""Hypothesis strategies for op sequences of the vocabulary in docs/ops.md: a leaf.

Each strategy draws plain JSON-able dicts (or lists of them) sized for a
2-core CPU: at most ``MAX_ROWS`` rows, short prompts, blocks of a few tokens.
Strategies that depend on the current batch take its geometry as arguments;
they never look at a cache. A strategy for one op lives in that op's module
(``tqbatch.testing.contract.ops``), and one drawn from several op modules
(a batch's first ops) in ``tqbatch.testing.contract.ops.batches``; here, what
needs no op module: the size bounds, seeds, configurations and prefills. It
imports nothing of tqbatch.
"""

from __future__ import annotations

import functools

from hypothesis import strategies as st

__all__ = [
    "MAX_ROWS",
    "MAX_PROMPT",
    "MAX_BLOCK",
    "configs",
    "seeds",
    "left_padded_prefill_ops",
    "right_padded_prefill_ops",
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


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
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


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
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
