"""The oracles the target is compared with.

* ``DenseReference``: mlx-lm's ``BatchKVCache`` fed the same full-precision K/V
  and the same ops. It defines the geometry (offsets, left padding, written
  end, masks) a batch cache must keep in lockstep with.
* ``TurboReferences``: per request, what a single-request
  ``mlx_vlm.turboquant.TurboQuantKVCache(bits, seed)`` fed only that
  request's tokens holds. TurboQuant quantizes token by token with codecs
  fixed by (head_dim, bits, seed), so a batch row must hold exactly the codes
  this reference holds.

Known defects of ``BatchKVCache`` (mlx-lm 0.32.2) and what the oracle does
about them, so that it is only consulted where it is right:

1. ``filter`` does not filter pending right padding: the oracle filters
   ``_right_padding`` itself after calling ``filter``.
2. ``filter`` shifts by the smallest left padding even when that is past the
   written end (an empty, left-padded cache, or rows still all padding),
   driving ``_idx`` negative: the oracle never shifts past the written end
   (it applies the filter by hand in that case, the same arithmetic capped).
3. ``extend`` drops pending right padding: the oracle concatenates it itself.
4. ``extract`` ignores pending right padding: it is not consulted for
   ``extract`` while right padding is pending.
5. ``make_mask`` ignores ``return_array`` (always an array): harmless here.

Where tqbatch's policy differs from ``BatchKVCache`` and a target may follow
either (``tqbatch.testing.contract.checks``, policy level), the oracle follows the
target: its ``state`` does not carry pending right padding, so after a round
trip that drops it (check ``roundtrip_pending``) ``_right_padding`` is cleared.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from tqbatch.testing.oracles.codec_round_trip import round_trip
from tqbatch.testing.oracles.reference_codecs import reference_codecs
from tqbatch.testing.oracles.rounding import AdmissibleCodes
from tqbatch.testing.oracles.tolerances import content_tolerance, excess_ratios

__all__ = ["DenseReference", "TurboReferences", "as_ints", "to_numpy", "to_numpy_all"]


def to_numpy(x) -> np.ndarray:
    """A numpy copy of an MLX array (bool arrays stay bool)."""
    return to_numpy_all(x)[0]


def to_numpy_all(*arrays) -> list[np.ndarray]:
    """``to_numpy`` of each MLX array, computed in one ``mx.eval`` (one wait, not one each)."""
    widened = [_widened(x) for x in arrays]
    mx.eval(widened)
    return [np.array(x) for x in widened]


def _widened(x: mx.array) -> mx.array:
    """``x`` with half floats as float32 (numpy has no bfloat16)."""
    return x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x


def _buffer_view(x: mx.array) -> np.ndarray:
    """A numpy view of ``x``'s memory (evaluated; half floats widened as ``to_numpy``
    does): valid until MLX next writes into it (a slice update may reuse the buffer),
    so copy what is kept."""
    return np.asarray(memoryview(_widened(x)))


def _read_only(x: np.ndarray) -> np.ndarray:
    x.flags.writeable = False
    return x


def as_ints(x) -> list[int]:
    """A flat list of Python ints from an MLX array, numpy array, list or scalar."""
    if isinstance(x, mx.array):
        mx.eval(x)
        x = np.array(x)
    return [int(v) for v in np.asarray(x).reshape(-1).tolist()]


# (checks, written end, left padding) -> BatchKVCache's masks; see DenseReference.masks.
_MASKS: dict[tuple, list[np.ndarray]] = {}
_MASKS_KEPT = 1024  # at most about 10 MB (4 rows, 300 slots); cleared when full


class DenseReference:
    """mlx-lm's ``BatchKVCache`` in full precision, with snapshotting read-outs."""

    def __init__(self, cache: BatchKVCache):
        self.cache = cache

    @classmethod
    def empty(cls, left_padding: Sequence[int]) -> DenseReference:
        return cls(BatchKVCache(list(left_padding)))

    @classmethod
    def merged(cls, members: Sequence[tuple[np.ndarray, np.ndarray]]) -> DenseReference:
        """Merge single full-precision requests, each (H, T, D) keys and values."""
        singles = []
        for keys, values in members:
            c = KVCache()
            if keys.shape[1] > 0:
                c.update_and_fetch(mx.array(keys[None]), mx.array(values[None]))
            singles.append(c)
        return cls(BatchKVCache.merge(singles))

    # ----------------------------------------------------------- read-outs
    # BatchKVCache mutates its arrays in place: always hand out copies.

    @property
    def offsets(self) -> list[int]:
        return [int(v) for v in np.array(self.cache.offset).tolist()]

    @property
    def left_padding(self) -> list[int]:
        return [int(v) for v in np.array(self.cache.left_padding).tolist()]

    def size(self) -> int:
        return int(self.cache._idx)

    @property
    def right_padding(self) -> list[int] | None:
        rp = self.cache._right_padding
        return None if rp is None else [int(v) for v in np.array(rp).tolist()]

    def masks(self, checks: Sequence[tuple[int, int | None]]) -> list[np.ndarray]:
        """``make_mask(n, window_size=w)`` per ``(n, w)`` of ``checks``, in one evaluation.

        BatchKVCache's mask is mlx-lm's ``create_causal_mask`` of ``n``, the
        window, its ``_idx`` and its left padding, nothing else: the masks are
        made once per such geometry and process (the same few geometries come
        back in every example) and handed out read-only.
        """
        key = (tuple(checks), self.size(), tuple(self.left_padding))
        if key not in _MASKS:
            if len(_MASKS) >= _MASKS_KEPT:
                _MASKS.clear()
            made = [self.cache.make_mask(n, return_array=True, window_size=w) for n, w in checks]
            _MASKS[key] = [_read_only(mask.astype(bool)) for mask in to_numpy_all(*made)]
        return _MASKS[key]

    def to_evaluate(self) -> list[mx.array]:
        """The arrays the read-outs read: evaluated with the target's reads after an op, they
        are read without a wait of their own."""
        c = self.cache
        arrays = [c.offset, c.left_padding]
        return arrays if c.keys is None else [*arrays, c.keys, c.values]

    def rows_tokens(self, rows: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per row of ``rows``: its full-precision (H, T, D) keys and values from its left
        padding to the written end, copied out of one read of the buffers (cutting rows in
        MLX would be an evaluation more)."""
        if self.cache.keys is None:
            raise ValueError("the dense oracle is empty")
        padding, end = self.left_padding, self.size()
        keys, values = (_buffer_view(x) for x in (self.cache.keys, self.cache.values))
        return [
            (keys[b, :, padding[b] : end].copy(), values[b, :, padding[b] : end].copy())
            for b in rows
        ]

    # ----------------------------------------------------------- operations

    def update(self, keys: np.ndarray, values: np.ndarray):
        self.cache.update_and_fetch(mx.array(keys), mx.array(values))
        mx.eval(self.cache.keys, self.cache.values, self.cache.offset)

    def prepare(self, left_padding=None, right_padding=None):
        self.cache.prepare(left_padding=left_padding, right_padding=right_padding)

    def finalize(self):
        self.cache.finalize()

    def trim(self, n: int) -> int:
        return self.cache.trim(n)

    def filter(self, indices: Sequence[int]):
        c = self.cache
        pending = self.right_padding
        kept_padding = [self.left_padding[i] for i in indices]
        if min(kept_padding) > self.size():
            # Defect 2: BatchKVCache would shift past the written end. Apply the
            # same filter with the shift capped at the written end.
            index = mx.array(list(indices))
            shift = self.size()
            if c.keys is not None:
                c.keys = c.keys[index][..., shift:, :]
                c.values = c.values[index][..., shift:, :]
            c.offset = mx.array(np.array(c.offset)[list(indices)])
            c.left_padding = mx.array(np.array(kept_padding) - shift)
            c._idx -= shift
        else:
            c.filter(mx.array(list(indices)))
        if pending is not None:  # defect 1
            c._right_padding = mx.array([pending[i] for i in indices])

    def extend(self, other: DenseReference):
        mine, theirs = self.right_padding, other.right_padding
        B1, B2 = len(self.offsets), len(other.offsets)
        self.cache.extend(other.cache)
        if mine is not None or theirs is not None:  # defect 3
            self.cache._right_padding = mx.array((mine or [0] * B1) + (theirs or [0] * B2))

    def copy(self) -> BatchKVCache:
        """A ``BatchKVCache`` holding copies of this one's arrays (handed to a target)."""
        c, twin = self.cache, BatchKVCache(self.left_padding)
        if c.keys is not None:
            twin.keys, twin.values = mx.array(c.keys), mx.array(c.values)
        twin.offset, twin.left_padding = mx.array(c.offset), mx.array(c.left_padding)
        twin._idx = c._idx
        return twin

    def extract(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Full-precision (H, T, D) keys and values of ``BatchKVCache.extract(b)``."""
        single = self.cache.extract(b)
        keys, values = to_numpy_all(single.keys[0], single.values[0])
        return keys, values


class TurboReferences:
    """What a single-request ``TurboQuantKVCache(bits, seed)`` holds, per request id.

    TurboQuant quantizes token by token with codecs fixed by (head_dim, bits,
    seed), so a request's reference is its own tokens through mlx-vlm's
    codecs: quantized, then dequantized. Held as float32 ``(H, T, D)`` numpy
    arrays, appended to and cut as the request grows and is trimmed. The
    codecs are those of a ``TurboQuantKVCache`` with this configuration
    (``tqbatch.testing.oracles.reference_codecs``: at integer widths, one pair per
    configuration and process), and one op's new tokens, of every request,
    go through them in one round trip (``tqbatch.testing.oracles.codec_round_trip``):
    a cache per request fed one op at a time was a third of the harness's
    time per example. ``tests/unit/test_reference_cache.py`` shows the result
    equal to what a ``TurboQuantKVCache`` per request holds. A round trip is
    read out when the tokens are first read, so that it is evaluated with
    the target's reads after the op (``to_evaluate``) instead of on its own.
    """

    def __init__(self, bits: float, seed: int, key_bits=None, value_bits=None):
        self.config = dict(bits=bits, seed=seed, key_bits=key_bits, value_bits=value_bits)
        self._codecs: tuple | None = None  # (key codec, value codec), built on the first tokens
        self._tokens: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # Round trips not yet read out: (items appended, keys, values (H, T, D)).
        self._unread: list[tuple[list, mx.array, mx.array]] = []
        # The full-precision tokens behind each request's reference, for
        # admit_rounding; and the admissible-code models of the two codecs.
        self._entered: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._admissible: tuple | None = None
        # Tokens whose reference took a cache's other rounding choice (see admit_rounding).
        self.admitted = 0

    def new(self, request_id: int):
        self._read_out()
        self._tokens[request_id] = None

    def absorb(self, other: TurboReferences):
        self._read_out()
        other._read_out()
        self._tokens.update(other._tokens)
        self._entered.update(other._entered)

    def to_evaluate(self) -> list[mx.array]:
        """The round trips not yet read out (evaluated with the target's reads)."""
        return [x for _, keys, values in self._unread for x in (keys, values)]

    def _read_out(self) -> None:
        """Append the round trips not yet read out to their requests, in one evaluation."""
        if not self._unread:
            return
        unread, self._unread = self._unread, []
        read = to_numpy_all(*(x for _, keys, values in unread for x in (keys, values)))
        for (items, _, _), new_k, new_v in zip(unread, read[::2], read[1::2]):
            start = 0
            for rid, k, _ in items:
                stop = start + k.shape[1]
                self._tokens[rid] = _appended(
                    self._tokens.get(rid), new_k[:, start:stop], new_v[:, start:stop]
                )
                start = stop

    def append(self, request_id: int, keys: np.ndarray, values: np.ndarray):
        """Append (H, T, D) float32 tokens to one request."""
        self.append_rows([(request_id, keys, values)])

    def append_rows(self, items: Sequence[tuple[int, np.ndarray, np.ndarray]]):
        """Append ``(request id, keys (H, T, D), values)`` to each request, in one codec call."""
        items = [(rid, k, v) for rid, k, v in items if k.shape[1] > 0]
        if not items:
            return
        keys = np.concatenate([k for _, k, _ in items], axis=1)[None]
        values = np.concatenate([v for _, _, v in items], axis=1)[None]
        self._unread.append((items, *self._round_trip(mx.array(keys), mx.array(values))))
        for rid, k, v in items:
            self._entered[rid] = _appended(self._entered.get(rid), k, v)

    def _round_trip(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """(H, T, D) float32 dequantized codes of (1, H, T, D) keys and values, unevaluated."""
        if self._codecs is None:
            self._codecs = reference_codecs(self.config, keys, values)
        key_codec, value_codec = self._codecs
        # As TurboQuantKVCache.update_and_fetch quantizes and .dequantize reads back.
        k = round_trip(key_codec, keys).astype(mx.float32)
        v = round_trip(value_codec, values).astype(mx.float32)
        return k[0], v[0]

    def trim(self, request_id: int, n: int):
        self._read_out()
        for store in (self._tokens, self._entered):
            held = store.get(request_id)
            if n > 0 and held is not None:
                keep = max(0, held[0].shape[1] - n)
                store[request_id] = (_frozen(held[0][:, :keep]), _frozen(held[1][:, :keep]))

    def admit_rounding(
        self, request_id: int, side: str, got: np.ndarray, tol: np.ndarray
    ) -> np.ndarray | None:
        """Take a cache's tokens where they differ from the reference only as rounding allows.

        ``side``: "keys" or "values"; ``got``: (H, T', D) dequantized tokens
        of the request as a cache holds them (T' <= its length: a prefix);
        ``tol``: their per-token bound (``content_tolerance``). Where a token
        of ``got`` is past ``tol`` from the reference but is the
        dequantization of codes and a norm that float rounding lets a
        correct quantizer choose (``tqbatch.testing.oracles.rounding``), the
        reference holds ``got``'s token from now on, so that every later
        check (rows, attention, extract) compares the cache with its own
        legitimate choice. Returns the request's reference tokens on that side
        (H, T, D) after taking them, or None where none was taken.
        """
        self._read_out()
        held, entered = self._tokens.get(request_id), self._entered.get(request_id)
        if held is None or entered is None or self._codecs is None:
            return None
        i = 0 if side == "keys" else 1
        n = got.shape[1]
        want = held[i][:, :n]
        if got.shape != want.shape:
            return None
        differs = (excess_ratios(got, want, tol) > 1.0).any(axis=-1)
        if not differs.any():
            return None
        if self._admissible is None:
            self._admissible = tuple(AdmissibleCodes(c) for c in self._codecs)
        admitted = differs & self._admissible[i].admits(got, entered[i][:, :n], tol)
        if not admitted.any():
            return None
        taken = np.array(held[i])
        taken[:, :n][admitted] = got[admitted]
        taken = _frozen(taken)
        self._tokens[request_id] = (taken, held[1]) if i == 0 else (held[0], taken)
        self.admitted += int(admitted.sum())
        return taken

    def admit_rounding_row(self, request_id: int, keys: np.ndarray, values: np.ndarray) -> bool:
        """``admit_rounding`` on both sides of a request as a cache holds it.

        ``keys``, ``values``: (H, T', D) dequantized tokens (T' <= the
        reference's length), each side judged within its ``content_tolerance``.
        Returns whether any token was taken.
        """
        taken = False
        sides = zip(("keys", "values"), (keys, values), self.dequantized(request_id))
        for side, got, held in sides:
            if held is not None and got.ndim == 3 and got.shape[1] <= held.shape[1]:
                tol = content_tolerance(held[:, : got.shape[1]])
                taken |= self.admit_rounding(request_id, side, got, tol) is not None
        return taken

    def length(self, request_id: int) -> int:
        self._read_out()
        held = self._tokens.get(request_id)
        return 0 if held is None else held[0].shape[1]

    def dequantized(self, request_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(H, T, D) float32 keys and values the reference holds (read-only), or (None, None)."""
        self._read_out()
        held = self._tokens.get(request_id)
        if held is None or held[0].shape[1] == 0:
            return None, None
        return held


def _appended(held, keys: np.ndarray, values: np.ndarray):
    """``held`` (keys, values) with (H, T, D) tokens appended along T, frozen."""
    if held is None:  # copies: the caller's arrays must not be frozen with ours
        keys, values = np.array(keys, np.float32), np.array(values, np.float32)
    else:  # concatenate makes new arrays
        keys = np.concatenate([held[0], keys], axis=1)
        values = np.concatenate([held[1], values], axis=1)
    return _frozen(keys), _frozen(values)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a
