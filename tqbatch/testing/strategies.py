"""Hypothesis strategies for op dicts of the vocabulary in docs/ops.md.

Each strategy draws plain JSON-able dicts (or lists of them) sized for a
2-core CPU: at most ``MAX_ROWS`` rows, short prompts, blocks of a few tokens.
Strategies that depend on the current batch take its geometry as arguments;
they never look at a cache.
"""

from __future__ import annotations

from hypothesis import strategies as st

from tqbatch.testing.checks import POLICY_CASES

__all__ = [
    "MAX_ROWS",
    "MAX_PROMPT",
    "configs",
    "seeds",
    "merge_op",
    "left_padded_prefill_ops",
    "right_padded_prefill_ops",
    "first_batch_ops",
    "other_batch_ops",
    "attend_op",
    "filter_indices",
    "bad_input_cases",
    "bad_input_op",
    "expect_error_op",
    "BAD_INPUT_ERRORS",
    "POLICY_CASES",
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
    constructor cannot take (``capabilities``, ``tqbatch.testing.impl``:
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
def merge_op(draw, max_rows: int = MAX_ROWS, rebatch: bool = False):
    """Merge of single requests, empty members (length 0) included.

    Some members may be full-precision ``KVCache``s; all of them only when
    ``rebatch`` (a batch is running, whose class supplies the configuration).
    """
    lengths = draw(st.lists(st.integers(0, MAX_PROMPT), min_size=1, max_size=max_rows))
    op = {"op": "merge", "lengths": lengths, "kv_seed": draw(seeds)}
    n = len(lengths)
    full = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n), label="full precision")
    if len(full) == n and not rebatch:
        full = full[:-1]
    if full:
        op["full_precision"] = sorted(full)
    return op


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


def first_batch_ops(capabilities: dict, max_rows: int = MAX_ROWS):
    """Ops that create a batch, using only what the target supports."""
    options = [
        st.lists(st.integers(0, 3), min_size=1, max_size=max_rows).map(
            lambda lp: [{"op": "new", "left_padding": lp}]
        )
    ]
    if capabilities.get("merge"):
        options += [merge_op(max_rows).map(lambda op: [op]), b1_decoded_ops()]
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


@st.composite
def attend_op(draw, kv_heads: int, max_queries: int = MAX_BLOCK):
    """A forward step: N queries (GQA: q_heads a multiple of kv_heads), N new tokens."""
    n = draw(st.integers(1, max_queries))
    op = {
        "op": "attend",
        "queries": n,
        "q_heads": kv_heads * draw(st.sampled_from([1, 2])),
        "q_seed": draw(seeds),
        "kv_seed": draw(seeds),
    }
    if draw(st.integers(0, 3)) == 0:
        op["window_size"] = draw(st.integers(1, 6))
    return op


@st.composite
def filter_indices(draw, left_padding: list[int]):
    """A non-empty subset of rows in any order; often keeps or drops the unpadded row."""
    B = len(left_padding)
    keep = draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=B, unique=True))
    zero_rows = [b for b, p in enumerate(left_padding) if p == 0]
    if zero_rows and B > 1 and draw(st.booleans()):
        # Drop every unpadded row: the compaction case (omlx #2172).
        rest = [b for b in keep if b not in zero_rows] or [
            b for b in range(B) if b not in zero_rows
        ][:1]
        keep = rest or keep
    return keep


def bad_input_cases(
    batch_size: int, written: int, capabilities: dict, world_seed: int
) -> list[tuple[str, dict]]:
    """Every bad-input ``(case, inner op)`` that applies to a batch of this geometry.

    The catalogue ``bad_input_op`` draws from, and that a test can walk case
    by case (tqbatch's pytest plugin does). ``written``: the written end (0:
    nothing written yet); ``capabilities`` (``tqbatch.testing.impl``) leaves
    out cases of operations the target lacks.
    """
    B = batch_size
    choices = [("update-rows", {"op": "update", "tokens": 1, "kv_seed": 0, "rows": B + 1})]
    if written:
        # Only once a write has fixed the geometry: an empty cache's first
        # write may bring any head count and head_dim.
        choices += [
            ("update-head-dim", {"op": "update", "tokens": 1, "kv_seed": 0, "head_dim": 16}),
            ("update-heads", {"op": "update", "tokens": 1, "kv_seed": 0, "heads": 3}),
        ]
    if capabilities.get("filter"):
        choices += [
            ("filter-out-of-range", {"op": "filter", "indices": [B]}),
            ("filter-repeated", {"op": "filter", "indices": [0, 0]}),
            ("filter-empty", {"op": "filter", "indices": []}),
        ]
    if capabilities.get("extract"):
        choices.append(("extract-out-of-range", {"op": "extract", "index": B}))
    if capabilities.get("trim"):
        choices.append(("trim-negative", {"op": "trim", "n": -1}))
    if capabilities.get("prepare"):
        choices += [
            (
                "prepare-negative-right",
                {"op": "prepare", "left_padding": None, "right_padding": [-1] * B},
            ),
            (
                "prepare-left-length",
                {"op": "prepare", "left_padding": [0] * (B + 1), "right_padding": None},
            ),
        ]
        if written:
            choices += [
                (
                    "prepare-left-after-write",
                    {"op": "prepare", "left_padding": [1] * B, "right_padding": None},
                ),
                # a valid right padding with the refused left one: nothing may stick
                (
                    "prepare-both-after-write",
                    {"op": "prepare", "left_padding": [1] * B, "right_padding": [1] * B},
                ),
            ]
    if capabilities.get("extend"):
        other = [
            {"op": "new", "left_padding": [0], "seed": world_seed + 1},
            {"op": "update", "tokens": 2, "kv_seed": 1},
        ]
        if capabilities.get("seed", True):  # the other batch is built with another seed
            choices.append(("extend-mixed-config", {"op": "extend", "other": other}))
        choices.append(
            (
                "extend-foreign",
                {"op": "extend", "other": [{"op": "new", "left_padding": [0]}], "foreign": True},
            )
        )
    if capabilities.get("merge"):
        choices += [
            (
                "merge-mixed-config",
                {"op": "merge", "lengths": [2, 3], "kv_seed": 0, "member_seeds": [0, 1]},
            ),
            ("merge-foreign", {"op": "merge", "lengths": [2, 1], "kv_seed": 0, "foreign": True}),
        ]
    return choices


def expect_error_op(case: str, inner: dict) -> dict:
    """The ``expect_error`` op of bad-input ``case``: ``inner`` must raise its documented error."""
    return {"op": "expect_error", "inner": inner, "error": BAD_INPUT_ERRORS[case], "case": case}


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


# The exception each bad-input case must raise: tqbatch's policy (README, Errors).
# TypeError for a wrong kind of object, IndexError for an index past the batch,
# ValueError for everything else.
BAD_INPUT_ERRORS = {
    "update-rows": "ValueError",
    "update-head-dim": "ValueError",
    "update-heads": "ValueError",
    "filter-out-of-range": "IndexError",
    "filter-repeated": "ValueError",
    "filter-empty": "ValueError",
    "extract-out-of-range": "IndexError",
    "trim-negative": "ValueError",
    "prepare-negative-right": "ValueError",
    "prepare-left-length": "ValueError",
    "prepare-left-after-write": "ValueError",
    "prepare-both-after-write": "ValueError",
    "extend-mixed-config": "ValueError",
    "extend-foreign": "TypeError",
    "merge-mixed-config": "ValueError",
    "merge-foreign": "TypeError",
}
