"""``expect_error``: bad input must be rejected with its documented error, changing nothing."""

from __future__ import annotations

import builtins
import functools

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from tqbatch.testing.contract.checks import (
    CONTRACT,
    POLICY,
    Check,
    CheckFailure,
    ToleratedDivergence,
)
from tqbatch.testing.contract.invariants import MASK_CHECKS, copied
from tqbatch.testing.contract.ops.declaration import Op, Rule
from tqbatch.testing.oracles.reference import as_ints, to_numpy, to_numpy_all


def _error_type(op) -> type[BaseException] | None:
    exc_type = getattr(builtins, op["error"], None)
    if isinstance(exc_type, type) and issubclass(exc_type, BaseException):
        return exc_type
    return None


def _validate(world, op):
    if _error_type(op) is None:
        raise ValueError(f"expect_error: {op['error']!r} is not a builtin exception type")
    if op["inner"].get("op") not in world.vocabulary.ops:
        raise ValueError(f"expect_error: unknown inner op {op['inner'].get('op')!r}")


def _run(world, op):
    """The inner op's target phase between two snapshots of the target; settles the op's
    failures itself (raises, or returns the expected error's name)."""
    inner, expected, exc_type = op["inner"], op["error"], _error_type(op)
    before = _read_snapshot(world, op)
    accepted = False
    with world.failures.collecting() as found:
        try:
            world.vocabulary.ops[inner["op"]].target(world, inner)
        except (CheckFailure, ToleratedDivergence):  # from the nested world of an extend
            raise
        except exc_type:
            pass
        except Exception as exc:
            # Rejected all the same: another policy, reported as such; the
            # snapshot below still holds the cache to "nothing changed".
            world.report(
                "error_type",
                op,
                f"expected {expected}, the target raised {type(exc).__name__}: {exc}",
            )
        else:
            accepted = True
            policy = op.get("case") in world.vocabulary.policy_cases
            check = "rejects_by_policy" if policy else "rejects"
            world.report(check, op, f"expected {expected}, the target accepted the op")
        if not accepted:
            # Rejected: nothing may have changed. (An accepted op changed the
            # cache as ops do: "unchanged" has nothing to hold it to.)
            after = _read_snapshot(world, op)
            for key in before:
                a, b = before[key], after[key]
                if not _same(a, b):
                    world.report(
                        "unchanged",
                        op,
                        f"the rejected op changed the target's {key}: {a!r} -> {b!r}",
                    )
    world.failures.settle(found)
    return expected


def _read_snapshot(world, op) -> dict:
    try:
        return _snapshot(world)
    except Exception as exc:
        # Nothing more of the op can be compared.
        world.failures.stop("read", op, f"reading the target raised {type(exc).__name__}: {exc}")
        raise


def _snapshot(world) -> dict:
    if world.target is None:
        return {}
    t = world.target
    pending = getattr(t, "_right_padding", None)  # mlx-lm's name for it
    snap = {
        "offset": as_ints(t.offset),
        "left_padding": as_ints(t.left_padding),
        "size": as_ints(t.size()),
        "masks": [_array(t.make_mask(n, return_array=True, window_size=w)) for n, w in MASK_CHECKS],
        "default masks": [copied(t.make_mask(n, window_size=w)) for n, w in MASK_CHECKS],
        "pending right padding": None if pending is None else as_ints(pending),
        "configuration": tuple(
            getattr(t, name, None) for name in ("bits", "key_bits", "value_bits", "seed")
        ),
        # The codec objects themselves: a rejected op must not swap them, even
        # for codecs of the same head_dim and bits (another seed).
        "codecs": tuple(getattr(t, name, None) for name in ("key_codec", "value_codec")),
    }
    if world.capabilities["dequantize"] and not t.empty() and world.numpy_model.end > 0:
        snap["keys"], snap["values"] = (_array(x) for x in t.dequantize())
    # Every array read in one evaluation (one wait, not one per array).
    arrays = [*snap["masks"], *snap["default masks"], snap.get("keys"), snap.get("values")]
    arrays = [x for x in arrays if isinstance(x, mx.array)]
    read = dict(zip(map(id, arrays), to_numpy_all(*arrays)))
    for key in ("masks", "default masks"):
        snap[key] = [read[id(m)] if isinstance(m, mx.array) else repr(m) for m in snap[key]]
    for key in ("keys", "values"):
        if key in snap:
            snap[key] = read[id(snap[key])]
    return snap


def _array(x) -> mx.array:
    """A copy of ``x``, which must be an MLX array (a read failure otherwise, as converting
    it would)."""
    if not isinstance(x, mx.array):
        to_numpy(x)  # raises what reading a non-array raises
    return copied(x)


def _same(a, b) -> bool:
    """Equality of snapshot entries: arrays element-wise (NaN equal), lists item by item."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@st.composite
def bad_input_op(
    draw,
    vocabulary,
    batch_size: int,
    written: int,
    capabilities: dict,
    world_seed: int,
    avoid=frozenset(),
):
    """An ``expect_error`` op whose inner op the contract requires to be rejected, from
    ``vocabulary``'s bad-input catalogue (``Vocabulary.bad_input_cases``).

    Each op names its ``case``: the identity a survey reports it under.
    Cases in ``avoid`` are not drawn (while any other is left).
    """
    choices = vocabulary.bad_input_cases(batch_size, written, capabilities, world_seed)
    choices = [c for c in choices if c[0] not in avoid] or choices
    # The op kind first, then the variant: every kind of bad input is equally
    # likely, however many variants it has (a flat draw under-samples kinds
    # listed late, such as extend with a mixed configuration).
    kind = draw(_one_of_kinds(tuple(sorted({inner["op"] for _, inner in choices}))))
    case, inner = draw(st.sampled_from([c for c in choices if c[1]["op"] == kind]))
    return vocabulary.expect_error_op(case, inner)


@functools.cache  # one object per arguments: Hypothesis analyses every new strategy
def _one_of_kinds(kinds: tuple[str, ...]):
    return st.sampled_from(kinds)


def _bad_input(machine, data):
    op = data.draw(
        bad_input_op(
            machine.world.vocabulary,
            machine.numpy_model.batch_size,
            machine.numpy_model.end,
            machine.caps,
            machine.world.seed,
            avoid=type(machine).avoid_cases,
        ),
        label="bad input",
    )
    return [op]


OP = Op(
    name="expect_error",
    fields="`inner: op`, `error: str`",
    meaning="the inner op must raise that exception type and leave the target unchanged",
    target=_run,
    oracles=lambda world, op, expected: expected,  # the oracles never see a rejected op
    validate=_validate,
    optional=(
        (
            "`case: str`",
            "the bad input's name (`tqbatch.testing.contract.ops.BAD_INPUT_ERRORS`): a "
            "survey reports each case as its own failure",
        ),
    ),
    checks=(
        Check("unchanged", CONTRACT, True, "a rejected op leaves the cache exactly as it was"),
        Check("rejects", CONTRACT, True, "bad input that has no sound meaning is rejected"),
        Check(
            "rejects_by_policy",
            POLICY,
            True,
            "bad input a cache could define a meaning for (tqbatch rejects it) is rejected",
        ),
        Check("error_type", POLICY, False, "bad input is rejected with the documented type"),
    ),
    rules=(Rule("bad_input", _bad_input),),
    notes=(
        "`expect_error.error` names a builtin exception type; a subclass matches. A different "
        "exception is a *policy* difference (check `error_type`); an accepted op (`rejects`) or "
        "a changed cache (`unchanged`) are failures. The checks and their levels: "
        "`tqbatch.testing.contract.ops.CHECKS`.",
    ),
)
