"""``merge``: a new batch from single-request caches (``Impl.merge``)."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from tqbatch.testing.contract.ops.declaration import BadInput, Op, Rule, out_of_domain
from tqbatch.testing.contract.strategies import MAX_PROMPT, MAX_ROWS, seeds
from tqbatch.testing.oracles.generation import POISON
from tqbatch.testing.oracles.reference import DenseReference
from tqbatch.testing.oracles.vectorized_fallback import vectorized_fallback


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
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


# How the target is built, as replay reports it (``construction``).
BY_MERGE = "merge"
BY_PREFILL = "constructor(left_padding) + padded prefill"


def merge_only(op: dict) -> str | None:
    """Why this merge has no construction but ``Impl.merge`` itself; None where it has one.

    These variants test what ``Impl.merge`` does with its members (quantize
    full-precision ones, refuse foreign types or mixed configurations): no
    constructor-built batch holds the same question.
    """
    if op.get("foreign"):
        return "foreign members test Impl.merge's own type check"
    if op.get("full_precision"):
        return "full-precision members are quantized by Impl.merge itself"
    if len(set(op.get("member_seeds") or ())) > 1:
        return "members of mixed configurations test Impl.merge's own check"
    return None


def construction(world, op: dict) -> str | None:
    """How ``op`` builds the batch on ``world``'s target; None where it cannot."""
    if world.capabilities["merge"]:
        return BY_MERGE
    return None if merge_only(op) else BY_PREFILL


def _validate(world, op):
    if op.get("foreign"):
        raise out_of_domain(op, "foreign members must be refused by any cache")
    if len(set(op.get("member_seeds") or ())) > 1:
        raise out_of_domain(op, "members of mixed configurations must be refused by any cache")


def _batch_seed(world, op) -> int:
    """The codec seed of the batch: its members' (uniform here), else the world's."""
    seeds_ = op.get("member_seeds")
    return int(seeds_[0]) if seeds_ else world.seed


def _needs(world, op) -> tuple[str, ...]:
    if construction(world, op) == BY_PREFILL:
        return world.configuration_needs(_batch_seed(world, op))
    return ("merge",)


def _members(op, rng, H: int, D: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each member's (H, n, D) keys and values, drawn in member order."""
    scale = op.get("scale", 1.0)
    return [
        (
            (rng.standard_normal((H, n, D)) * scale).astype(np.float32),
            (rng.standard_normal((H, n, D)) * scale).astype(np.float32),
        )
        for n in (int(n) for n in op["lengths"])
    ]


def _target(world, op):
    rng = np.random.default_rng(op["kv_seed"])
    members = _members(op, rng, world.kv_heads, world.head_dim)
    if construction(world, op) == BY_PREFILL:
        return _by_prefill(world, op, members, rng), members
    return _by_merge(world, op, members), members


def _by_merge(world, op, members):
    lengths = [k.shape[1] for k, _ in members]
    seeds_ = op.get("member_seeds") or [world.seed] * len(lengths)
    full_precision = set(op.get("full_precision") or ())
    if op.get("foreign"):
        # Affine-quantized: not the request's exact K/V, so never a member.
        # Left empty (its group sizes do not divide every head_dim): the
        # type alone must be refused.
        singles = [QuantizedKVCache(group_size=32, bits=4) for _ in lengths]
    else:
        singles = [
            KVCache() if i in full_precision else world.single(s) for i, s in enumerate(seeds_)
        ]
    # The harness's own writes: mlx-vlm's update_and_fetch, its fallback vectorized.
    with vectorized_fallback():
        for single, (k, v) in zip(singles, members):
            if k.shape[1] and not op.get("foreign"):
                single.update_and_fetch(mx.array(k[None]), mx.array(v[None]))
    merge = world.impl.merge
    if full_precision and len(full_precision) == len(lengths):
        # No member carries a configuration: re-batch through the running
        # batch's class, as mlx-vlm's qwen3_5 does after running rows alone.
        if world.target is None:
            raise ValueError("merge of only full-precision members needs a batch to re-batch")
        merge = type(world.target).merge
    return merge(singles)


def _by_prefill(world, op, members, rng):
    """The merged batch as a target without ``merge`` builds it: ``Impl(left_padding)``,
    then one ``(B, H, longest, D)`` write holding each member right-aligned.

    TurboQuant quantizes token by token, so the members' codes are the ones
    merge copies from their single caches; only the padding slots differ
    (never read: masked). They hold poison, as every padding slot the
    harness writes (``tqbatch.testing.oracles.generation``). Not built by ``extend``
    of single rows: that would make every scenario's first op depend on
    ``extend``, an op with defects of its own (mlx-vlm's loses rows when
    one side is empty).
    """
    lengths = [k.shape[1] for k, _ in members]
    longest = max(lengths)
    target = world.construct([longest - n for n in lengths], seed=_batch_seed(world, op))
    if longest:
        shape = (len(members), world.kv_heads, longest, world.head_dim)
        keys = (rng.standard_normal(shape) * POISON).astype(np.float32)
        values = (rng.standard_normal(shape) * POISON).astype(np.float32)
        for row, (k, v) in enumerate(members):
            keys[row, :, longest - k.shape[1] :] = k
            values[row, :, longest - v.shape[1] :] = v
        target.update_and_fetch(mx.array(keys), mx.array(values))
    return target


def _oracles(world, op, ctx):
    world.target, members = ctx
    requests = [world.numpy_model.new_request(k, v) for k, v in members]
    world.numpy_model.reset_merged(requests)
    world.dense = DenseReference.merged(members)
    for req in requests:
        world.refs.new(req.id)
    world.refs.append_rows([(req.id, req.keys, req.values) for req in requests])


def _restart(machine, data):
    return [data.draw(merge_op(rebatch=True), label="merge")]


OP = Op(
    name="merge",
    fields="`lengths: [int]`, `kv_seed: int`",
    meaning="replace the target with `Impl.merge` of single-request `TurboQuantKVCache`s; "
    "request i is prefilled with `lengths[i]` tokens (0 = empty member)",
    target=_target,
    oracles=_oracles,
    validate=_validate,
    needs=("merge",),
    needs_of=_needs,
    optional=(
        ("`scale: float`", "K/V scale of the members' tokens"),
        ("`member_seeds: [int]`", "codec seed per member (bad input: mixed configurations)"),
        (
            "`full_precision: [int]`",
            "members at these indices are mlx-lm `KVCache`s (full precision, quantized by the "
            "merge); all of them: merged by `type(target).merge`, the running batch's class",
        ),
        ("`foreign: true`", "members are mlx-lm `QuantizedKVCache`s (affine-quantized, bad input)"),
    ),
    bad_inputs=(
        BadInput(
            "merge-mixed-config",
            "ValueError",
            lambda batch: {"op": "merge", "lengths": [2, 3], "kv_seed": 0, "member_seeds": [0, 1]},
        ),
        BadInput(
            "merge-foreign",
            "TypeError",
            lambda batch: {"op": "merge", "lengths": [2, 1], "kv_seed": 0, "foreign": True},
        ),
    ),
    notes=(
        "`merge` against a target without `Impl.merge`: the same batch is built by "
        "`Impl(left_padding=[longest - lengths[i]])` and one `update_and_fetch` of "
        "`(B, H, longest, D)` K/V holding member i's tokens right-aligned (padding slots "
        "poisoned); codes are per token, so the request slots equal merge's. `foreign`, "
        "`full_precision` and mixed `member_seeds` test merge itself: without `Impl.merge` "
        "the scenario skips. A replay reports the construction it used.",
    ),
    rules=(
        Rule(
            "restart_with_merge",
            _restart,
            lambda machine: machine.has("merge"),
            doc="A new batch from singles (the old one is finished).",
        ),
    ),
)
