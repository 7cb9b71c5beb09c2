"""Shared machinery of the unit tests: K/V generation, a lockstep driver, snapshots.

``Lockstep`` drives three things with the same operations and the same
full-precision K/V:

* the cache under test (``tqbatch.BatchTurboQuantKVCache``),
* mlx-lm's ``BatchKVCache`` (the geometry oracle: offsets, left padding,
  written end, masks),
* per request, the request's real tokens in full precision, from which a
  single-request ``mlx_vlm.turboquant.TurboQuantKVCache`` with the same bits
  and seed is built on demand (the content oracle).

TurboQuant quantizes each token on its own with a codec that is a pure
function of (head_dim, bits, seed), so a batch row must hold exactly the
packed bits that the single-request cache holds: packed states are compared
bit for bit, dequantized values within the rounding bounds of
``tqbatch.testing.oracles.tolerances``.

Why a driver beside the harness's ``tqbatch.testing.contract.ops.World``: ``World``
judges any implementation from the outside (values it can read through the
public API, rounding choices admitted), while these unit tests look inside
tqbatch's own cache, comparing its packed bits with a single-request cache's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch import BatchTurboQuantKVCache
from tqbatch.testing.oracles.generation import POISON
from tqbatch.testing.oracles.numpy_model import causal_mask
from tqbatch.testing.oracles.tolerances import attention_tolerance, content_tolerance
from tqbatch.testing.target import load_impl

# The class under test: tqbatch's own unless $TQBATCH_IMPL / --impl names
# another (e.g. a mutant from tqbatch.testing.mutants, to see these tests fail).
Impl: type[BatchTurboQuantKVCache] = load_impl()

H = 2
D = 64

# Dequantized rows and batched attention are compared with the per-request
# reference within the rounding bounds of tqbatch.testing.oracles.tolerances: the same
# packed codes by another route (batch shapes, masked kernels), derived for the
# matmul precision in effect rather than measured on one machine.
# Padding positions are filled with the harness's poison scale, so that attending
# to even one of them moves the output far beyond those bounds.
POISON_SCALE = POISON


def normal(rng: np.random.Generator, shape, scale: float = 1.0) -> mx.array:
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))


def leaves(state) -> list[mx.array]:
    return [leaf for _, leaf in tree_flatten(state)]


def packed_rows_equal(batch_state, row: int, start: int, stop: int, single_state) -> bool:
    """Whether batch row ``row``, slots [start, stop), holds exactly ``single_state``'s bits."""
    a, b = leaves(batch_state), leaves(single_state)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        part = x[row : row + 1, :, start:stop]
        if part.shape != y.shape or part.dtype != y.dtype:
            return False
        if not bool(mx.array_equal(part, y).item()):
            return False
    return True


@dataclass
class Request:
    """One request's real (unpadded) tokens in full precision, (H, n, D) each."""

    keys: np.ndarray
    values: np.ndarray

    @classmethod
    def empty(cls, heads: int = H, dim: int = D) -> Request:
        z = np.zeros((heads, 0, dim), dtype=np.float32)
        return cls(z, z.copy())

    def __len__(self) -> int:
        return self.keys.shape[1]

    def append(self, keys: np.ndarray, values: np.ndarray):
        self.keys = np.concatenate([self.keys, keys], axis=1)
        self.values = np.concatenate([self.values, values], axis=1)

    def drop_last(self, n: int):
        keep = max(0, len(self) - n)
        self.keys, self.values = self.keys[:, :keep], self.values[:, :keep]

    def reference(self, bits, seed, **kw) -> TurboQuantKVCache:
        """A single-request TurboQuantKVCache holding exactly these tokens."""
        ref = TurboQuantKVCache(bits=bits, seed=seed, **kw)
        if len(self):
            ref.update_and_fetch(mx.array(self.keys[None]), mx.array(self.values[None]))
        return ref


@dataclass
class Lockstep:
    """The cache under test, BatchKVCache and per-request references, moved together."""

    tq: BatchTurboQuantKVCache
    dense: BatchKVCache
    requests: list[Request]
    bits: float = 4.0
    seed: int = 0
    heads: int = H
    dim: int = D
    bits_kw: dict = field(default_factory=dict)
    # right padding declared by prepare() and not yet finalized, per row
    pending_right: list[int] | None = None

    # ------------------------------------------------------------ construction

    @classmethod
    def merge(
        cls,
        lengths: list[int],
        rng: np.random.Generator,
        *,
        bits: float = 4.0,
        seed: int = 0,
        heads: int = H,
        dim: int = D,
        **bits_kw,
    ) -> Lockstep:
        """Merge single-request caches prefilled with ``lengths[i]`` tokens (0 = empty)."""
        singles, denses, requests = [], [], []
        for n in lengths:
            single = TurboQuantKVCache(bits=bits, seed=seed, **bits_kw)
            dense = KVCache()
            req = Request.empty(heads, dim)
            if n:
                k = normal(rng, (1, heads, n, dim))
                v = normal(rng, (1, heads, n, dim))
                single.update_and_fetch(k, v)
                dense.update_and_fetch(k, v)
                req.append(np.array(k[0]), np.array(v[0]))
            singles.append(single)
            denses.append(dense)
            requests.append(req)
        tq = Impl.merge(singles)
        return cls(tq, BatchKVCache.merge(denses), requests, bits, seed, heads, dim, dict(bits_kw))

    @classmethod
    def new(
        cls,
        left_padding: list[int],
        *,
        bits: float = 4.0,
        seed: int = 0,
        heads: int = H,
        dim: int = D,
        **bits_kw,
    ) -> Lockstep:
        tq = Impl(list(left_padding), bits=bits, seed=seed, **bits_kw)
        requests = [Request.empty(heads, dim) for _ in left_padding]
        return cls(
            tq, BatchKVCache(list(left_padding)), requests, bits, seed, heads, dim, dict(bits_kw)
        )

    # ------------------------------------------------------------ operations

    @property
    def batch(self) -> int:
        return len(self.requests)

    def prepare(self, left_padding=None, right_padding=None):
        self.tq.prepare(left_padding=left_padding, right_padding=right_padding)
        self.dense.prepare(left_padding=left_padding, right_padding=right_padding)
        if right_padding is not None and max(right_padding) > 0:
            self.pending_right = list(right_padding)

    def _chunk(self, rng, tokens: int, poison_rng=None):
        """K/V for the next ``tokens`` slots (padding poisoned) and each row's real range."""
        B, n_heads, dim = self.batch, self.heads, self.dim
        keys = np.array(normal(rng, (B, n_heads, tokens, dim)))
        values = np.array(normal(rng, (B, n_heads, tokens, dim)))
        poison = poison_rng if poison_rng is not None else np.random.default_rng(12345)
        before = self.dense.offset.tolist()
        real = []
        for b in range(B):
            if self.pending_right is not None:
                # Right-padded prefill: the row's real tokens come first.
                lo, hi = 0, tokens - self.pending_right[b]
            else:
                # Left padding: slots before the row's first real slot are dead.
                lo, hi = max(0, -before[b]), tokens
            lo, hi = min(max(lo, 0), tokens), min(max(hi, 0), tokens)
            dead = np.ones(tokens, dtype=bool)
            dead[lo:hi] = False
            for arr in (keys, values):
                arr[b, :, dead] = poison.standard_normal((dead.sum(), n_heads, dim)) * POISON_SCALE
            real.append((lo, hi))
        return keys, values, real

    def update(self, rng: np.random.Generator, tokens: int = 1, poison_rng=None):
        """``update_and_fetch`` of ``tokens`` new slots on every row; returns the tq output."""
        return self._update(rng, tokens, poison_rng)[0]

    def _update(self, rng, tokens, poison_rng):
        keys, values, real = self._chunk(rng, tokens, poison_rng)
        out = self.tq.update_and_fetch(mx.array(keys), mx.array(values))
        self.dense.update_and_fetch(mx.array(keys), mx.array(values))
        for b, (lo, hi) in enumerate(real):
            self.requests[b].append(keys[b, :, lo:hi], values[b, :, lo:hi])
        return out, real

    def attend(
        self,
        rng: np.random.Generator,
        queries: int = 1,
        q_heads: int | None = None,
        poison_rng=None,
    ) -> list[tuple[mx.array, mx.array, np.ndarray]]:
        """Write ``queries`` new slots and attend ``queries`` queries over the cache.

        The mask comes from ``make_mask`` before the write, as a model computes
        it. Returns, per row, (batched output at the row's real query positions,
        the same queries attended over the row's request alone in a
        single-request ``TurboQuantKVCache``, the rounding bound between the
        two). Queries at padding positions have no reference and are left out.
        """
        q_heads = q_heads or self.heads
        B = self.batch
        before = [len(r) for r in self.requests]
        mask = self.tq.make_mask(queries, return_array=True)
        q = normal(rng, (B, q_heads, queries, self.dim))
        (ks, vs), real = self._update(rng, queries, poison_rng)
        scale = 1.0 / math.sqrt(self.dim)
        out = scaled_dot_product_attention(q, ks, vs, self.tq, scale=scale, mask=mask)
        pairs = []
        for b, req in enumerate(self.requests):
            lo, hi = real[b]
            if hi <= lo:
                continue
            ref = Request(req.keys[:, : before[b]], req.values[:, : before[b]]).reference(
                self.bits, self.seed, **self.bits_kw
            )
            rk, rv = ref.update_and_fetch(
                mx.array(req.keys[None, :, before[b] :]),
                mx.array(req.values[None, :, before[b] :]),
            )
            n = hi - lo
            ref_mask = create_causal_mask(n, offset=before[b]) if n > 1 else None
            want = scaled_dot_product_attention(
                q[b : b + 1, :, lo:hi], rk, rv, ref, scale=scale, mask=ref_mask
            )
            ref_k, ref_v = (np.array(x[0]) for x in ref.dequantize())
            allowed = causal_mask(n, before[b], [0])[0, 0]
            tol = attention_tolerance(np.array(q[b, :, lo:hi]), ref_k, ref_v, allowed, scale)
            pairs.append((out[b : b + 1, :, lo:hi], want, tol))
        return pairs

    def finalize(self):
        self.tq.finalize()
        self.dense.finalize()
        self.pending_right = None

    def filter(self, indices: list[int]):
        self.tq.filter(indices)
        self.dense.filter(mx.array(indices))
        self.requests = [self.requests[i] for i in indices]
        if self.pending_right is not None:
            self.pending_right = [self.pending_right[i] for i in indices]

    def extend(self, other: Lockstep):
        self.tq.extend(other.tq)
        self.dense.extend(other.dense)
        self.requests = self.requests + other.requests

    def trim(self, n: int) -> int:
        trimmed = self.tq.trim(n)
        assert trimmed == self.dense.trim(n)
        for req in self.requests:
            req.drop_last(n)
        return trimmed

    def roundtrip(self):
        """Replace the cache under test with a copy rebuilt from state/meta_state."""
        self.tq = Impl.from_state(self.tq.state, self.tq.meta_state)

    # ------------------------------------------------------------ checks

    def check_geometry(self):
        """Offsets, left padding, written end and masks equal BatchKVCache's exactly."""
        tq, dense = self.tq, self.dense
        assert tq.offset.tolist() == dense.offset.tolist()
        assert tq.left_padding.tolist() == dense.left_padding.tolist()
        size = tq.size()
        assert type(size) is int and size == dense.size()
        for n in (1, 3):
            for return_array in (False, True):
                for window in (None, 2):
                    got = tq.make_mask(n, return_array=return_array, window_size=window)
                    want = dense.make_mask(n, return_array=return_array, window_size=window)
                    assert_same_mask(got, want)

    def check_rows(self):
        """Each row's written tokens are bit-identical to its request's single-request cache."""
        tq = self.tq
        offsets, padding, size = tq.offset.tolist(), tq.left_padding.tolist(), tq.size()
        assert [max(0, o) for o in offsets] == [len(r) for r in self.requests]
        if size == 0:
            return
        keys, values = tq.dequantize()
        assert keys.dtype == mx.float32 and values.dtype == mx.float32
        assert keys.shape == (self.batch, self.heads, size, self.dim)
        assert values.shape == (self.batch, self.heads, size, self.dim)
        state = tq.state
        for b, req in enumerate(self.requests):
            if not len(req):
                continue
            start = padding[b]
            assert start + offsets[b] == size
            ref = req.reference(self.bits, self.seed, **self.bits_kw)
            ref_keys, ref_values = ref.dequantize()
            assert packed_rows_equal(state[0], b, start, size, ref.state[0])
            assert packed_rows_equal(state[1], b, start, size, ref.state[1])
            for got, want in ((keys, ref_keys), (values, ref_values)):
                got, want = np.array(got[b : b + 1, :, start:]), np.array(want)
                assert np.all(np.abs(got - want) <= content_tolerance(want))

    def check(self):
        self.check_geometry()
        self.check_rows()


def assert_same_mask(got, want):
    if want is None or got is None:
        assert got is None and want is None
        return
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    assert bool(mx.array_equal(got, want).item())


def assert_attention_matches(pairs: list[tuple[mx.array, mx.array]]):
    assert pairs, "no real query to compare"
    for got, want, tol in pairs:
        assert got.shape == want.shape
        assert np.all(np.abs(np.array(got)[0] - np.array(want)[0]) <= tol)


# ---------------------------------------------------------------- snapshots


def observe(cache: BatchTurboQuantKVCache) -> dict:
    """Every observable of ``cache`` as plain Python values (for exact comparison)."""
    state = cache.state
    packed = []
    for part in state[:2]:
        if part is None:
            packed.append(None)
            continue
        packed.append([(str(a.dtype), tuple(a.shape), np.array(a).tobytes()) for a in leaves(part)])
    mask = cache.make_mask(2, return_array=True)
    return {
        "type": type(cache),
        "offset": cache.offset.tolist(),
        "left_padding": cache.left_padding.tolist(),
        "size": cache.size(),
        "empty": cache.empty(),
        "nbytes": cache.nbytes,
        "packed": packed,
        "state_offset": state[2].tolist(),
        "state_left_padding": state[3].tolist(),
        "meta_state": tuple(cache.meta_state),
        "mask": (tuple(mask.shape), np.array(mask).tobytes()),
        "config": (cache.bits, cache.key_bits, cache.value_bits, cache.seed),
        "codecs": tuple(
            None if c is None else (type(c).__name__, c.dim, c.bits)
            for c in (cache.key_codec, cache.value_codec)
        ),
        "right_padding": None if cache._right_padding is None else cache._right_padding.tolist(),
        "pending restore": getattr(cache, "_restoring", None),
    }


def assert_rejected(
    cache: BatchTurboQuantKVCache,
    call: Callable[[], object],
    error: type[BaseException],
    *patterns: str,
):
    """``call()`` raises ``error`` whose message matches every regex in ``patterns``
    (case-insensitive), and leaves every observable of ``cache`` as it was."""
    before = observe(cache)
    codecs = (cache.key_codec, cache.value_codec)
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message, re.IGNORECASE), (pattern, message)
    assert observe(cache) == before
    # The codec objects themselves: a rejected call neither rebuilds nor swaps them.
    assert (cache.key_codec, cache.value_codec) == codecs
    return info.value


def then_still_in_lockstep(ls: Lockstep, rng):
    """After a rejected call: the batch is still in lockstep, and still takes a write."""
    ls.check()
    ls.update(rng, 1)
    ls.check()


# ---------------------------------------------------------------- the fused CUDA decode kernel


def cache_decode_step(rng: np.random.Generator):
    """A two-row cache (row 0 left-padded by 2, 5 tokens, 2 KV heads, D = 64, 4 bits) at a
    decode step, as a model takes it: the mask made before the step's write. Returns
    (cache, queries, keys, values, mask), 4 query heads."""
    cache = BatchTurboQuantKVCache([2, 0], bits=4)
    k = mx.array(rng.standard_normal((2, 2, 5, 64)).astype(np.float16))
    cache.update_and_fetch(k, k)
    mask = cache.make_mask(1)
    step = mx.array(rng.standard_normal((2, 2, 1, 64)).astype(np.float16))
    ks, vs = cache.update_and_fetch(step, step)
    q = mx.array(rng.standard_normal((2, 4, 1, 64)).astype(np.float16))
    return cache, q, ks, vs, mask


def forbid_cuda_kernel(monkeypatch) -> None:
    """MLX as on a Mac or a CPU-only build (no CUDA backend to report), and the fused CUDA
    decode kernel failing the test if anything reaches it."""
    from tqbatch import _cuda_decode

    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_cuda_decode, "_fused", lambda *a: pytest.fail("kernel reached"))


def campaign_summary(result) -> tuple:
    """What two runs of one campaign must agree on: examples, op counts, failures and their
    lengths."""
    return (
        result.examples,
        dict(result.op_counts),
        sorted((f.key, len(f.ops)) for f in result.failures),
    )
