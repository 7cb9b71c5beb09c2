"""Token- and row-axis operations on packed TurboQuant states.

A packed state (``TurboQuantMSEState`` and friends from ``mlx_vlm.turboquant``)
is a NamedTuple tree whose leaves are arrays laid out as ``(B, H, T, ...)``:
norms are ``(B, H, T)``, packed indices ``(B, H, T, P)``. Every operation the
batch cache needs is the same operation applied to every leaf on axis 0 (rows)
or axis 2 (tokens), so each helper here is one ``tree_map``. None of them
quantizes or dequantizes: they move packed bits, which keeps them exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

TOKEN_AXIS = 2


def leaves(state) -> list[mx.array]:
    return [leaf for _, leaf in tree_flatten(state)]


def length(state) -> int:
    """Number of token slots (allocated capacity) of ``state``."""
    return leaves(state)[0].shape[TOKEN_AXIS]


def rows(state) -> int:
    return leaves(state)[0].shape[0]


def heads(state) -> int:
    return leaves(state)[0].shape[1]


def token_range(state, start: int, end: int):
    return tree_map(lambda a: a[:, :, start:end], state)


def select_rows(state, indices: mx.array):
    return tree_map(lambda a: a[indices], state)


def concat_tokens(states: Sequence):
    return tree_map(lambda *parts: mx.concatenate(parts, axis=TOKEN_AXIS), *states)


def zeros_like(state, batch: int, tokens: int):
    """Zero-filled state shaped like ``state`` with ``batch`` rows and ``tokens`` slots."""

    def _zeros(a):
        shape = (batch, a.shape[1], tokens, *a.shape[3:])
        return mx.zeros(shape, dtype=a.dtype)

    return tree_map(_zeros, state)


def right_aligned(blocks: Sequence[tuple], template, end: int):
    """Stack blocks of rows into one batch, every row ending at slot ``end``.

    ``blocks`` holds ``(state, rows, length)``: ``rows`` rows whose slots
    ``[0, length)`` of ``state`` land at ``[end - length, end)``, preceded by
    zeros (``state`` is ``None`` for rows with nothing written). One zero
    allocation per leaf and one write per block: half the copies of
    pad-then-concatenate.
    """
    out = zeros_like(template, sum(rows for _, rows, _ in blocks), end)
    first = 0
    for state, n_rows, n in blocks:
        if state is not None and n > 0:

            def _write(dst, src, first=first, n_rows=n_rows, n=n):
                dst[first : first + n_rows, :, end - n : end] = src[:, :, :n]
                return dst

            out = tree_map(_write, out, state)
        first += n_rows
    return out


def pad_left(state, tokens: int):
    """Prepend ``tokens`` zero slots to every row."""
    if tokens == 0:
        return state
    return concat_tokens([zeros_like(state, rows(state), tokens), state])


def roll_rows(state, shifts: mx.array):
    """Roll row ``b`` right by ``shifts[b]`` slots along the token axis.

    Slot ``j`` of row ``b`` moves to ``(j + shifts[b]) % T``. A gather, so the
    packed bits come out unchanged.
    """
    n = length(state)
    # (B, T) source slot for every destination slot.
    source = (mx.arange(n)[None, :] - shifts[:, None]) % n

    def _roll(a):
        index = source.reshape(source.shape[0], 1, n, *([1] * (a.ndim - 3)))
        return mx.take_along_axis(a, index, axis=TOKEN_AXIS)

    return tree_map(_roll, state)


def write_tokens(dst, src, start: int):
    """Write ``src`` into ``dst`` at token slot ``start`` (in place on ``dst``'s leaves)."""
    end = start + length(src)

    def _write(d, s):
        d[:, :, start:end] = s
        return d

    return tree_map(_write, dst, src)


def grow(state, used: int, needed: int, step: int):
    """Return ``state`` with capacity for ``needed`` slots, keeping slots ``[0, used)``.

    Capacity grows to the next multiple of ``step`` so that decode does not
    reallocate on every token.
    """
    if length(state) >= needed:
        return state
    capacity = ((needed + step - 1) // step) * step
    kept = token_range(state, 0, used)
    return concat_tokens([kept, zeros_like(state, rows(state), capacity - used)])


def detach(state):
    """A copy whose leaves are new array objects.

    MLX writes (``a[...] = x``) rebind the array object they are applied to;
    a cache that kept a caller's objects would write into the caller's state.
    """
    return tree_map(lambda a: mx.array(a), state)


def nbytes(state) -> int:
    return sum(leaf.nbytes for leaf in leaves(state))
