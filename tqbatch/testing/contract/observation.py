"""What a replay records about each step: the target's state, and what the op yielded.

``World.step`` (``tqbatch.testing.world``) produces one observation per op:
``of_target`` after every op, and the op module's ``Op.observe`` for what the
op yielded; ``tqbatch.testing.replay.replayer`` only compares it with a recording.
Packed states are kept as raw bytes (their dtype untouched), masks as
booleans, outputs as float32 with NaN where unspecified.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tqbatch.testing.oracles.reference import as_ints, to_numpy

__all__ = ["MASK_FORMS", "ObservationError", "of_target", "packed_leaves"]

# make_mask forms recorded after every op: (N, window_size).
MASK_FORMS = ((1, None), (3, None), (3, 2))


class ObservationError(Exception):
    """Reading the target raised: a target that cannot even be observed has diverged."""


def _unwrap(state):
    return getattr(state, "_state", state)


def packed_leaves(state, prefix: str) -> dict[str, np.ndarray]:
    """Leaves of a packed state as raw numpy arrays (no dtype conversion: bytes matter)."""
    state = _unwrap(state)
    if state is None:
        return {}
    if hasattr(state, "_fields"):
        items = zip(state._fields, state)
    elif isinstance(state, (list, tuple)):
        items = ((str(i), s) for i, s in enumerate(state))
    else:
        items = [("data", state)]
    out = {}
    for name, leaf in items:
        if isinstance(leaf, mx.array):
            mx.eval(leaf)
            out[f"{prefix}.{name}"] = np.array(leaf, copy=True)
        elif hasattr(leaf, "_fields") or isinstance(leaf, (list, tuple)):
            out.update(packed_leaves(leaf, f"{prefix}.{name}"))
    return out


def _ints(x) -> np.ndarray:
    return np.array(as_ints(x), dtype=np.int64)


def of_target(target) -> dict[str, np.ndarray]:
    """What is recorded about a batch cache after every op: geometry, masks, packed bytes."""
    size = target.size()
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"size() returned {type(size).__name__} {size!r}, not an int")
    out = {
        "offset": _ints(target.offset),
        "left_padding": _ints(target.left_padding),
        "size": np.array([int(size)], dtype=np.int64),
        "has_idx": np.array(hasattr(target, "_idx")),
    }
    for n, window in MASK_FORMS:
        mask = to_numpy(target.make_mask(n, return_array=True, window_size=window))
        out[f"mask.n{n}.w{window or 0}"] = mask.astype(bool)
    state = target.state
    if state is not None and len(state) >= 2:
        out.update(packed_leaves(state[0], "state.keys"))
        out.update(packed_leaves(state[1], "state.values"))
    return out
