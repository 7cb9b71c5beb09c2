"""The batch's causal mask as numbers (a start per row), and the masks the cache made.

A batch cache's mask is causal over left-padded rows: query ``l`` of row
``b`` sees key columns ``starts[b] <= t <= offset + l``. Model code receives
it as a (B, 1, L, T) boolean array from ``make_mask`` and hands that array to
every layer's attention. ``CausalRows`` says the same in B + 2 numbers, which
is what a fused attention kernel takes (mlx-vlm's Metal kernels, for one, run
only where no mask array is given). The cache remembers each array it made,
by identity, with the ``CausalRows`` it was made from, so its attention can
attend with the numbers whenever model code passes that array on untouched;
any other mask (sliced, combined, made elsewhere) stays an array.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

__all__ = ["CausalRows", "made_by_cache", "remember"]


@dataclass(frozen=True)
class CausalRows:
    """Causal attention over left-padded rows: the numbers mlx-lm's ``create_causal_mask`` takes.

    ``starts``: (B,) int32, the first live column of each row (its left
    padding). ``offset``: the column of the first query's own token, so the
    mask has ``offset + L`` columns for ``L`` queries. ``window``: a sliding
    window, or None.
    """

    starts: mx.array
    offset: int
    window: int | None = None
    # The array these numbers describe, where one exists already (a mask
    # make_mask made, attached for one attention call, never kept in the
    # record of made masks): allowed() hands it out instead of rebuilding it.
    array: mx.array | None = field(default=None, compare=False, repr=False)

    def check_keys(self, n_queries: int, n_keys: int) -> None:
        """Raise ValueError unless these rows cover exactly ``n_keys`` keys for ``n_queries``."""
        if self.offset + n_queries != n_keys:
            raise ValueError(
                f"causal rows from offset {self.offset} cover {self.offset + n_queries} keys "
                f"for {n_queries} queries; the state holds {n_keys}"
            )

    def allowed(self, n_queries: int) -> mx.array:
        """The boolean mask, broadcastable to (B, 1, n_queries, offset + n_queries)."""
        if self.array is not None and self.array.shape[-2:] == (
            n_queries,
            self.offset + n_queries,
        ):
            return self.array
        return create_causal_mask(
            n_queries, offset=self.offset, window_size=self.window, left_padding=self.starts
        )


# id(mask array) -> (weak reference to it, the CausalRows it was made from).
# Entries go when the array does; the identity check on lookup guards
# against an id reused by a later object.
_made: dict[int, tuple[weakref.ref, CausalRows]] = {}


def remember(mask: mx.array, rows: CausalRows) -> mx.array:
    """Record that ``mask`` is exactly ``rows.allowed(L)``; returns ``mask``."""
    key = id(mask)
    _made[key] = (weakref.ref(mask, lambda _ref, key=key: _made.pop(key, None)), rows)
    return mask


def made_by_cache(mask) -> CausalRows | None:
    """The ``CausalRows`` a mask array was made from, or None for any other mask."""
    entry = _made.get(id(mask))
    if entry is None or entry[0]() is not mask:
        return None
    return entry[1]
