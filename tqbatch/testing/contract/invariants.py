"""The checks every op is held to: after every op, the target against the oracles.

Each check reports into the op's failures (``World.report``), so that one
quantity that cannot be read or is wrong leaves the others to be compared.
A check that cannot be evaluated because another failed (content when
``dequantize()`` has the wrong shape) is skipped. What the checks read of
the target is read first, in the order they use it, and evaluated in one
wait (``TargetReads``); a read that raised is reported by the check that
uses it, as if that check had read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from tqbatch.testing.contract.checks import ToleratedDivergence
from tqbatch.testing.oracles.judges import judge_tokens
from tqbatch.testing.oracles.numpy_model import causal_mask
from tqbatch.testing.oracles.reference import as_ints, to_numpy, to_numpy_all

__all__ = ["MASK_CHECKS", "check_all", "copied", "guarded", "read"]

# (N, window_size) pairs at which make_mask is compared after every op.
MASK_CHECKS = ((1, None), (3, None), (1, 2), (4, 3))


def check_all(world, op) -> None:
    """Every invariant of the current state, each reporting into the op's failures."""
    if world.contract_checks:
        guarded(world, _check_contract, op)
    reads = TargetReads.of(world)
    for check in (_check_geometry, _check_dense_matches_model, _check_masks, _check_rows):
        guarded(world, check, op, reads)


def guarded(world, check, op, *args) -> None:
    """``check(world, op, *args)``; where reading the target raises, a ``read`` failure."""
    try:
        check(world, op, *args)
    except (AssertionError, ToleratedDivergence):
        raise
    except Exception as exc:
        # A target that crashes while being read (size(), make_mask,
        # dequantize) is a failed check, reported like any other.
        world.report("read", op, f"reading the target raised {type(exc).__name__}: {exc}")


def read(world, op, reader: Callable[[], Any]) -> Any:
    """``reader()``, or None where it raises (a ``read`` failure)."""
    try:
        return reader()
    except Exception as exc:
        world.report("read", op, f"reading the target raised {type(exc).__name__}: {exc}")
        return None


def _check_contract(world, op):
    keys = getattr(world.target, "keys", None)
    if hasattr(world.target, "_idx") and not isinstance(keys, mx.array):
        world.report(
            "structure",
            op,
            "the cache has an `_idx` attribute but no dense keys: mlx-vlm's speculative "
            "rollback takes the dense-KVCache path on `_idx`",
        )


def _check_geometry(world, op, reads):
    m, d = world.numpy_model, world.dense
    # Each quantity on its own: one that cannot be read (a ``read`` failure)
    # leaves the others to be compared.
    got = {
        "offset": read(world, op, lambda: as_ints(_read(reads.offset))),
        "left_padding": read(world, op, lambda: as_ints(_read(reads.left_padding))),
        "size": read(world, op, lambda: _read(reads.size)),
    }
    size = got["size"]
    if size is not None and not isinstance(size, (int, np.integer)):
        world.report("size_type", op, f"size() returned {type(size).__name__} {size!r}, not an int")
        got["size"] = None
    want = {"offset": m.offsets, "left_padding": m.left_padding, "size": m.size()}
    dense = {"offset": d.offsets, "left_padding": d.left_padding, "size": d.size()}
    for key in want:
        if want[key] != dense[key]:
            world.report(
                "harness", op, f"the numpy model's {key} {want[key]} != BatchKVCache's {dense[key]}"
            )
        elif got[key] is not None and got[key] != want[key]:
            world.report(
                key, op, f"{key} is {got[key]}, BatchKVCache and the model have {want[key]}"
            )


def _check_dense_matches_model(world, op, reads):
    if world.dense.cache.keys is None:
        return
    model = world.numpy_model
    rows = [b for b in range(model.batch_size) if model.row_length(b) != 0]
    for b, (dk, dv) in zip(rows, world.dense.rows_tokens(rows)):
        mk, mv = model.tokens(b)
        if not (np.array_equal(dk, mk) and np.array_equal(dv, mv)):
            world.report("harness", op, f"BatchKVCache row {b} tokens disagree with the model")


def _check_masks(world, op, reads):
    dense = world.dense.masks(MASK_CHECKS)
    for (n, window), dense_mask, (raw, default) in zip(MASK_CHECKS, dense, reads.masks):
        want = world.numpy_model.mask(n, window)
        if dense_mask.shape != want.shape or not np.array_equal(dense_mask, want):
            world.report(
                "harness", op, f"BatchKVCache make_mask({n}, window_size={window}) != model's"
            )
        guarded(world, _check_mask, op, n, window, want, raw)
        guarded(world, _check_default_mask, op, n, window, want, default)


class _Raised:
    """A read of the target that raised: raised again where its check reads it (``_read``)."""

    def __init__(self, exc: Exception):
        self.exc = exc


def _read(value):
    if isinstance(value, _Raised):
        raise value.exc
    return value


class _Stop(Exception):
    """Reading stops: a read raised what the checks do not catch (``guarded``)."""


@dataclass
class TargetReads:
    """What the checks read of the target after an op, read before any is checked.

    The target is called as the checks call it, in their order: ``offset``,
    ``left_padding``, ``size()``, then per ``MASK_CHECKS`` entry ``make_mask``
    with ``return_array=True`` and without, then, where rows hold tokens to
    compare, ``empty()`` and ``dequantize()``. Every array read is evaluated
    in one ``mx.eval`` with what the oracles read next (``to_evaluate``): on
    MLX's CPU each evaluation is a wait for the stream's thread, and these
    were six an op.

    Each array is copied as it is returned: a later call writing into an array
    it returned (``a[i] = v`` writes to every holder) must not change what an
    earlier call returned. Other values read as they are (``offset`` and
    ``left_padding`` as ints, as the checks compare them). A read that raised
    holds its exception (``_Raised``); after one the checks do not catch
    (an ``AssertionError``, ``ToleratedDivergence``), nothing more is read,
    as the check that uses it raises it out. Where evaluating them together
    raises, each is left to its check to evaluate and report.
    """

    offset: Any = None
    left_padding: Any = None
    size: Any = None
    # Per MASK_CHECKS entry read: (with return_array, without); the last one's
    # second None where reading stopped before it.
    masks: list[tuple] = field(default_factory=list)
    empty: Any = None  # None: not read (no rows to compare, or reading stopped)
    dequantized: Any = None

    @classmethod
    def of(cls, world) -> TargetReads:
        reads = cls()
        try:
            reads._read_all(world)
        except _Stop:
            pass
        arrays = [x for x in reads._arrays() if isinstance(x, mx.array)]
        try:
            mx.eval(arrays, world.dense.to_evaluate(), world.refs.to_evaluate())
        except Exception:  # noqa: BLE001 - each check evaluates its own and reports what raises
            pass
        return reads

    def _read_all(self, world) -> None:
        t = world.target
        self.offset = _call(lambda: _geometry(t.offset))
        self.left_padding = _call(lambda: _geometry(t.left_padding))
        self.size = _call(lambda: t.size())
        masks = []
        for n, window in MASK_CHECKS:
            for kwargs in ({"return_array": True}, {}):
                masks.append(_call(lambda: copied(t.make_mask(n, window_size=window, **kwargs))))  # noqa: B023
                if _stops(masks[-1]):
                    self.masks = _pairs(masks)
                    raise _Stop
        self.masks = _pairs(masks)
        if _compares_rows(world):
            self.empty = _call(lambda: bool(t.empty()))  # as ``if t.empty():`` reads it
            if _stops(self.empty):
                raise _Stop
            if self.empty is False:
                self.dequantized = _call(lambda: t.dequantize())

    def _arrays(self) -> list:
        arrays = [self.offset, self.left_padding]
        arrays += [mask for pair in self.masks for mask in pair]
        if isinstance(self.dequantized, tuple):
            arrays += list(self.dequantized)
        return arrays


def _call(reader: Callable[[], Any]) -> Any:
    """``reader()``, or its exception held (``_Raised``)."""
    try:
        return reader()
    except Exception as exc:
        return _Raised(exc)


def _stops(value) -> bool:
    """Whether ``value`` holds an exception its check raises out (``guarded``)."""
    return isinstance(value, _Raised) and isinstance(
        value.exc, (AssertionError, ToleratedDivergence)
    )


def _geometry(value):
    """``offset`` or ``left_padding`` as read: an MLX array copied (evaluated with the
    rest), anything else as ints now."""
    return copied(value) if isinstance(value, mx.array) else as_ints(value)


def copied(x):
    """``x``, an array copied as it is read: evaluated later, it must not show a write the
    target makes into an array it returned (``a[i] = v`` reaches every holder)."""
    return mx.array(x) if isinstance(x, mx.array) else x


def _pairs(reads: list) -> list[tuple]:
    """(with return_array, without) per mask checked; the last one's second None where
    reading stopped before it."""
    return [
        (reads[i], reads[i + 1] if i + 1 < len(reads) else None) for i in range(0, len(reads), 2)
    ]


def _check_mask(world, op, n, window, want, raw):
    raw = _read(raw)
    if not isinstance(raw, mx.array):
        return world.report(
            "mask_form", op, f"make_mask({n}, return_array=True) returned {raw!r}, not an array"
        )
    got = to_numpy(raw)
    if got.dtype != np.bool_:
        return world.report("mask_form", op, f"make_mask({n}) has dtype {raw.dtype}, not bool")
    if got.shape != want.shape:
        return world.report(
            "mask_shape",
            op,
            f"make_mask({n}, window_size={window}) has shape {got.shape}, "
            f"BatchKVCache's is {want.shape}",
        )
    if not np.array_equal(got, want):
        rows = sorted({int(b) for b in np.argwhere(got != want)[:, 0]})
        world.report(
            "mask_values",
            op,
            f"make_mask({n}, window_size={window}) differs from BatchKVCache's in rows {rows}",
        )


def _check_default_mask(world, op, n, window, want, default):
    """``make_mask(n)`` as models call it (``return_array`` left False): ``default``.

    BatchKVCache returns the array; None (attend everything) or "causal" are
    as good only where they mean the same mask: no row padded, no window
    cutting in.
    """
    default = _read(default)
    if isinstance(default, mx.array):
        got = to_numpy(default)
        if got.shape != want.shape or not np.array_equal(got, want):
            world.report(
                "default_mask",
                op,
                f"make_mask({n}, window_size={window}) differs from BatchKVCache's",
            )
        return
    plain = causal_mask(n, world.numpy_model.end, [0] * world.numpy_model.batch_size, None)
    if default is None and want.all():
        return
    if isinstance(default, str) and default == "causal" and np.array_equal(want, plain):
        return
    world.report(
        "default_mask",
        op,
        f"make_mask({n}, window_size={window}) returned {default!r} where BatchKVCache's "
        "mask masks padding or a window",
    )


def _dequantized_rows(world, op, reads):
    """The target's ``dequantize()`` as (B, H, end, D) numpy keys and values, or None
    where its form does not let rows be told apart (reported)."""
    keys, values = _read(reads.dequantized)
    end, B = world.numpy_model.end, world.numpy_model.batch_size
    arrays = {}
    for name, x in (("keys", keys), ("values", values)):
        is_array = isinstance(x, mx.array)
        if not is_array or x.ndim != 4 or not mx.issubdtype(x.dtype, mx.floating):
            form = f"{x.dtype} {x.shape}" if is_array else type(x).__name__
            world.report("dequantize", op, f"dequantize() {name} are {form}, not a 4-D float array")
        else:
            arrays[name] = x
    if len(arrays) < 2:
        return None  # content cannot be read out of them
    keys, values = to_numpy_all(arrays["keys"], arrays["values"])
    evaluable = True
    if keys.shape[2] != end or values.shape[2] != end:
        world.report(
            "written_end",
            op,
            f"dequantize() has {keys.shape[2]} slots, expected the written end {end}",
        )
        evaluable = False
    for name, got in (("keys", keys), ("values", values)):
        # Heads and head_dim are each row's, checked with its content.
        if got.shape[0] != B:
            world.report(
                "dequantize",
                op,
                f"dequantize() {name} have {got.shape[0]} rows (shape {got.shape}), the batch {B}",
            )
            evaluable = False
    return (keys, values) if evaluable else None


def _compares_rows(world) -> bool:
    """Whether rows hold tokens whose content ``_check_rows`` compares."""
    model = world.numpy_model
    return bool(
        world.capabilities["dequantize"]
        and model.end != 0
        and any(model.row_length(b) for b in range(model.batch_size))
    )


def _check_rows(world, op, reads):
    if not _compares_rows(world):
        return
    rows = [b for b in range(world.numpy_model.batch_size) if world.numpy_model.row_length(b)]
    if _read(reads.empty):
        return world.report("content", op, f"the target is empty but rows {rows} hold tokens")
    both = _dequantized_rows(world, op, reads)
    if both is None:
        return  # rows cannot be told apart in these: content is not evaluated
    end = world.numpy_model.end
    for b in rows:
        lp = world.numpy_model.rows[b].left_padding
        rid = world.numpy_model.rows[b].request.id
        for side, (name, held) in enumerate(zip(("keys", "values"), both)):
            got = held[b, :, lp:end]
            want = world.refs.dequantized(rid)[side]
            if want is None or got.shape != want.shape:
                world.report(
                    "content",
                    op,
                    f"row {b} (request {rid}) {name} have shape (H, T, D) {got.shape}, the "
                    f"reference {None if want is None else want.shape}",
                )
                continue
            judgement = judge_tokens(
                got,
                lambda: world.refs.dequantized(rid)[side],  # noqa: B023 (judged at once)
                lambda tol: world.refs.admit_rounding(rid, name, got, tol) is not None,  # noqa: B023
            )
            if not judgement.passed:
                world.report(
                    "content",
                    op,
                    f"row {b} (request {rid}) dequantized {name} differ from the per-request "
                    f"TurboQuant reference {judgement.detail()} at token(s) {judgement.bad(1)[:8]}",
                )
