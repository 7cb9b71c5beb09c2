"""A plain numpy model of a batch cache: what every row should hold.

No MLX here. The model keeps, per row, the request it belongs to (with that
request's full-precision K/V tokens) and its left padding; for the batch, the
written end and any pending right padding. From these it predicts offsets,
``size()``, masks (computed here, independently of mlx-lm) and each row's
tokens. Geometry follows mlx-lm's ``BatchKVCache``: rows are right-aligned on
the written end, row ``b`` holds ``left_padding[b]`` dead slots and then its
tokens, so ``offset[b] == end - left_padding[b]`` (negative while a row is
still all padding).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["NumpyBatchModel", "Request", "Row", "causal_mask", "attention"]


@dataclass
class Request:
    """One request's full-precision tokens: keys/values are (H, T, D) float32."""

    id: int
    keys: np.ndarray
    values: np.ndarray

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def append(self, keys: np.ndarray, values: np.ndarray):
        self.keys = np.concatenate([self.keys, keys], axis=1)
        self.values = np.concatenate([self.values, values], axis=1)

    def truncate(self, length: int):
        self.keys = self.keys[:, :length]
        self.values = self.values[:, :length]


@dataclass
class Row:
    request: Request
    left_padding: int


def causal_mask(
    n_queries: int, end: int, left_padding: Sequence[int], window_size: int | None = None
) -> np.ndarray:
    """(B, 1, N, end + N) booleans: query i sits at slot end + i.

    Query i may see slot j iff j <= end + i (causal), j >= left_padding[b]
    (not padding) and, with a window, end + i - j < window_size.
    """
    q = end + np.arange(n_queries)[:, None]
    k = np.arange(end + n_queries)[None, :]
    allowed = k <= q
    if window_size is not None:
        allowed &= q - k < window_size
    lp = np.asarray(left_padding, dtype=np.int64).reshape(-1, 1, 1, 1)
    return allowed[None, None] & (k[None, None] >= lp)


@functools.lru_cache(maxsize=4096)
def _causal_mask_of(n_queries: int, end: int, left_padding: tuple, window_size) -> np.ndarray:
    mask = causal_mask(n_queries, end, left_padding, window_size)
    mask.flags.writeable = False  # shared by every caller of the same geometry
    return mask


def attention(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, mask, scale: float):
    """Float64 softmax attention of (Hq, N, D) queries over (H, L, D) K/V, GQA by repetition.

    ``mask`` is (N, L) booleans; a fully masked query row yields NaN.
    """
    repeat = queries.shape[0] // keys.shape[0]
    k = np.repeat(keys.astype(np.float64), repeat, axis=0)
    v = np.repeat(values.astype(np.float64), repeat, axis=0)
    scores = np.einsum("hnd,hld->hnl", queries.astype(np.float64), k) * scale
    scores = np.where(mask[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hnl,hld->hnd", weights, v)


class NumpyBatchModel:
    """The expected content and geometry of a batch cache."""

    def __init__(self, kv_heads: int, head_dim: int, ids: Iterator[int] | None = None):
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.rows: list[Row] = []
        self.end = 0
        self.right_padding: list[int] | None = None
        self._ids = ids if ids is not None else itertools.count()

    # ------------------------------------------------------------ construction

    def new_request(self, keys=None, values=None) -> Request:
        H, D = self.kv_heads, self.head_dim
        if keys is None:
            keys = values = np.zeros((H, 0, D), dtype=np.float32)
        return Request(next(self._ids), keys, values)

    def reset_empty(self, left_padding: Sequence[int]):
        """An empty batch, as ``Impl(left_padding)``: one fresh request per row."""
        self.rows = [Row(self.new_request(), int(p)) for p in left_padding]
        self.end = 0
        self.right_padding = None

    def reset_merged(self, requests: Sequence[Request]):
        """``Impl.merge`` of single requests: shorter ones left-padded."""
        longest = max(r.length for r in requests)
        self.rows = [Row(r, longest - r.length) for r in requests]
        self.end = longest
        self.right_padding = None

    # ------------------------------------------------------------ geometry

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def left_padding(self) -> list[int]:
        return [r.left_padding for r in self.rows]

    @property
    def offsets(self) -> list[int]:
        return [self.end - r.left_padding for r in self.rows]

    def size(self) -> int:
        return self.end

    def mask(self, n_queries: int, window_size: int | None = None) -> np.ndarray:
        """``causal_mask`` of the model's geometry: made once per geometry, read-only."""
        return _causal_mask_of(n_queries, self.end, tuple(self.left_padding), window_size)

    def row_length(self, b: int) -> int:
        """Slots of row ``b`` that hold its request's tokens."""
        return max(0, self.end - self.rows[b].left_padding)

    # ------------------------------------------------------------ operations

    def padding_slots(self, n_tokens: int) -> np.ndarray:
        """(B, T) booleans: which of the next ``n_tokens`` slots of each row are padding.

        Left padding: slots before ``left_padding[b]``. Pending right padding:
        the last ``right_padding[b]`` tokens of this write (a prefill's tail).
        """
        slots = self.end + np.arange(n_tokens)[None, :]
        padded = slots < np.array(self.left_padding)[:, None]
        if self.right_padding is not None:
            tail = np.arange(n_tokens)[None, :] >= n_tokens - np.array(self.right_padding)[:, None]
            padded |= tail
        return padded

    def write(self, keys: np.ndarray, values: np.ndarray) -> list[slice]:
        """Append (B, H, T, D) tokens at the written end.

        Returns, per row, the slice of the T new tokens that became request
        tokens (those at or after the row's left padding). Right-padding tails
        become request tokens until ``finalize`` removes them.
        """
        T = keys.shape[2]
        taken = []
        for b, row in enumerate(self.rows):
            first = min(T, max(0, row.left_padding - self.end))
            row.request.append(keys[b, :, first:], values[b, :, first:])
            taken.append(slice(first, T))
        self.end += T
        return taken

    def prepare(self, left_padding=None, right_padding=None):
        if left_padding is not None:
            for row, p in zip(self.rows, left_padding):
                row.left_padding += int(p)
        if right_padding is not None and max(right_padding) > 0:
            self.right_padding = [int(p) for p in right_padding]

    def finalize(self) -> list[int]:
        """Pending right padding becomes left padding; returns tokens dropped per row."""
        if self.right_padding is None:
            return [0] * self.batch_size
        dropped = []
        for row, p in zip(self.rows, self.right_padding):
            n = min(p, row.request.length)
            row.request.truncate(row.request.length - n)
            row.left_padding += p
            dropped.append(n)
        self.right_padding = None
        return dropped

    def filter(self, indices: Sequence[int]):
        self.rows = [self.rows[i] for i in indices]
        if self.right_padding is not None:
            self.right_padding = [self.right_padding[i] for i in indices]
        # Columns every survivor treats as padding are dead; never past the end.
        shift = min(min(self.left_padding), self.end)
        for row in self.rows:
            row.left_padding -= shift
        self.end -= shift

    def extend(self, other: NumpyBatchModel):
        end = max(self.end, other.end)
        for side in (self, other):
            for row in side.rows:
                row.left_padding += end - side.end
        if self.right_padding is not None or other.right_padding is not None:
            self.right_padding = (self.right_padding or [0] * self.batch_size) + (
                other.right_padding or [0] * other.batch_size
            )
        self.rows = self.rows + other.rows
        self.end = end

    def trim(self, n: int) -> tuple[int, list[int]]:
        """Drop the last ``n`` slots; returns (slots trimmed, tokens dropped per row)."""
        n = min(n, self.end)
        self.end -= n
        dropped = []
        for b, row in enumerate(self.rows):
            keep = self.row_length(b)
            dropped.append(row.request.length - keep)
            row.request.truncate(keep)
        return n, dropped

    def tokens(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``b``'s request tokens, (H, T, D) keys and values."""
        r = self.rows[b].request
        return r.keys, r.values
