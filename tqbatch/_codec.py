"""TurboQuant's MSE codec in a handful of vectorized ops: quantize, dequantize, attend.

mlx-vlm's codecs find each coordinate's code with a loop over the 2^b - 1
codebook midpoints and pack and unpack codes with a loop over the D
coordinates: thousands of tiny graph nodes per call, which is the whole cost
of a write or a decode step wherever mlx-vlm's Metal kernels do not replace
them (the CPU, NVIDIA GPUs). Here the code search is one broadcast comparison
with the midpoints (or, for large inputs, a b-step binary search over them),
packing is one gather, shift and sum over precomputed bit positions, and
codebook lookups read a byte or half-word of codes at once. The floating-point
steps (norms, rotations) are the codec's own calls in the codec's order and
lookups return the codec's own codebook values, so packed states are
bit-identical to mlx-vlm's and dequantized tokens equal
(``tests/unit/test_codec.py``).

``covers(codec)`` is the one place that says what this module serves: mlx-vlm's
MSE codec at integer bits 1-8, wherever the work does not run on Metal
(decided per call: ``tqbatch._devices``). Everything else stays on mlx-vlm's
path: fractional bits' split codecs (with mlx-vlm's Metal gate closed where
the work runs on the CPU), and the GPU on a Mac, where mlx-vlm's fused kernels
serve (fast there, and possibly rounding otherwise than these ops).

``quantize_plain``, ``dequantize_plain`` and ``attend_plain`` are the same ops
without the Metal gate (any ``servable`` codec, any device): on Metal they are
the plain-MLX reference that the backend check compares mlx-vlm's kernels with
(``tqbatch.testing.backend.kernel_check``).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from mlx_vlm.turboquant import _EPS, TurboQuantMSEState, _TurboQuantMSECodec

from tqbatch._devices import metal_kernels_here, mlx_vlm_follows_device
from tqbatch._masks import CausalRows

__all__ = [
    "attend",
    "attend_plain",
    "covers",
    "dequantize",
    "dequantize_plain",
    "pack",
    "quantize",
    "quantize_plain",
    "servable",
    "unpack",
]

# quantize/dequantize/attend take any codec and fall back to mlx-vlm's own
# methods for the ones ``covers`` declines, so callers need no branch.


def covers(codec) -> bool:
    """Whether ``codec`` is served here now: an MSE codec at integer bits 1-8, off Metal."""
    return servable(codec) and not metal_kernels_here()


def servable(codec) -> bool:
    """Whether the ops here compute ``codec``: an MSE codec at integer bits 1-8 (any device)."""
    return (
        type(codec) is _TurboQuantMSECodec
        and isinstance(codec.bits, int)
        and 1 <= codec.bits <= 8
        and codec.dim > 0
        and _sorted_midpoints(codec)
    )


def _sorted_midpoints(codec) -> bool:
    # The binary search needs ascending midpoints (a Lloyd-Max codebook is
    # sorted); checked once per codec, not trusted.
    cached = getattr(codec, "_tqbatch_sorted", None)
    if cached is None:
        mids = np.array(codec._midpoints)
        cached = bool(np.all(mids[1:] > mids[:-1]))
        codec._tqbatch_sorted = cached
    return cached


# ------------------------------------------------------------------ packing
# Code i of a row occupies bits [i*b, i*b + b) of the row's little-endian
# stream of uint32 words (mlx-vlm's layout); a code may spill into the next word.


@functools.cache
def _unpack_tables(dim: int, bits: int):
    start = np.arange(dim) * bits
    word, offset = start // 32, start % 32
    spill = offset + bits - 32
    has_spill = spill > 0
    high_word = np.where(has_spill, word + 1, word)
    high_shift = np.where(has_spill, bits - spill, 0)
    return tuple(
        mx.array(a.astype(np.uint32))
        for a in (word, offset, high_word, high_shift, has_spill.astype(np.uint32))
    )


@functools.cache
def _pack_tables(dim: int, bits: int):
    """Per word, the codes that touch it: (W, K) code index, left shift, right shift."""
    width = (dim * bits + 31) // 32
    members: list[list[tuple[int, int, int]]] = [[] for _ in range(width)]
    for i in range(dim):
        word, offset = divmod(i * bits, 32)
        members[word].append((i, offset, 0))  # low bits: code << offset (high bits fall off)
        spill = offset + bits - 32
        if spill > 0:
            members[word + 1].append((i, 0, bits - spill))  # the rest: code >> (bits - spill)
    k = max(len(m) for m in members)
    index = np.full((width, k), dim)  # index ``dim``: a zero code appended to each row
    left = np.zeros((width, k), np.uint32)
    right = np.zeros((width, k), np.uint32)
    for w, m in enumerate(members):
        for j, (i, lshift, rshift) in enumerate(m):
            index[w, j], left[w, j], right[w, j] = i, lshift, rshift
    return mx.array(index.reshape(-1).astype(np.uint32)), mx.array(left), mx.array(right), k


def pack(codes: mx.array, bits: int) -> mx.array:
    """(..., D) codes below 2**bits -> (..., ceil(D*bits/32)) uint32 words."""
    dim = codes.shape[-1]
    index, left, right, k = _pack_tables(dim, bits)
    codes = codes.astype(mx.uint32)
    padded = mx.concatenate([codes, mx.zeros((*codes.shape[:-1], 1), mx.uint32)], axis=-1)
    parts = mx.take(padded, index, axis=-1).reshape(*codes.shape[:-1], -1, k)
    # The pieces of one word occupy disjoint bits: their sum is their OR.
    return ((parts << left) >> right).sum(axis=-1).astype(mx.uint32)


def unpack(words: mx.array, bits: int, dim: int) -> mx.array:
    """(..., W) uint32 words -> (..., dim) uint32 codes."""
    word, offset, high_word, high_shift, has_spill = _unpack_tables(dim, bits)
    words = words.astype(mx.uint32)
    low = mx.take(words, word, axis=-1) >> offset
    high = (mx.take(words, high_word, axis=-1) << high_shift) * has_spill
    return (low | high) & ((1 << bits) - 1)


# ------------------------------------------------------------------ codec ops


# Below this many (coordinate, midpoint) pairs the count is one broadcast
# comparison (3 ops; a decode step's write at 8 bits is 8*8*128*255 = 2M);
# above it, a binary search keeps memory at the input's size (b steps).
_BROADCAST_LIMIT = 2**23


def _codes(codec, rotated: mx.array) -> mx.array:
    """The number of midpoints below each coordinate (mlx-vlm's count)."""
    mids = codec._midpoints
    if rotated.size * mids.shape[0] <= _BROADCAST_LIMIT:
        return (rotated[..., None] > mids).astype(mx.uint32).sum(axis=-1).astype(mx.uint32)
    code = mx.zeros(rotated.shape, dtype=mx.uint32)
    for step in reversed(range(codec.bits)):
        candidate = code + (1 << step)
        # Midpoint ``candidate - 1`` exists while candidate <= 2**bits - 1.
        valid = candidate <= mids.shape[0]
        probe = mx.take(mids, mx.minimum(candidate, mids.shape[0]) - 1)
        code = mx.where(valid & (rotated > probe), candidate, code)
    return code


def quantize(codec, vectors: mx.array):
    """``codec.quantize(vectors)``, bit for bit: float16 norms and packed codes."""
    if not covers(codec):
        with mlx_vlm_follows_device():
            return codec.quantize(vectors)
    return quantize_plain(codec, vectors)


def quantize_plain(codec, vectors: mx.array) -> TurboQuantMSEState:
    """``quantize`` in these plain ops on any device; ``codec`` must be ``servable``."""
    x = vectors.astype(mx.float32)
    norms = mx.linalg.norm(x, axis=-1)
    unit = x / mx.maximum(norms[..., None], _EPS)
    rotated = codec._rotate_forward(unit)
    return TurboQuantMSEState(norms.astype(mx.float16), pack(_codes(codec, rotated), codec.bits))


def _unit_codebook_vectors(codec, state: TurboQuantMSEState) -> mx.array:
    """Each token's codebook vector, in the codec's rotated basis (unit norm up to codes)."""
    if 8 % codec.bits == 0:
        # 1, 2, 4 and 8 bits: no code straddles a byte, so each byte (1, 2
        # bits) or 16-bit half-word (4, 8 bits) of the little-endian words
        # looks up all its codes' values at once. MLX's gather costs per
        # index, so fewer, wider lookups are faster; a 2**16-entry table of
        # 2 or 4 floats (0.5-1 MB) still sits in cache.
        unit = mx.uint16 if codec.bits >= 4 else mx.uint8
        data = state.indices.view(unit)
        vectors = mx.take(_lookup_table(codec, unit), data, axis=0)  # (..., n, codes per unit)
        return vectors.reshape(*data.shape[:-1], -1)[..., : codec.dim]
    codes = unpack(state.indices, codec.bits, codec.dim).astype(mx.int32)
    return mx.take(codec.codebook, codes, axis=0)


def _lookup_table(codec, unit) -> mx.array:
    """(2**width, width / bits) codebook values of the codes packed in each ``unit`` value,
    low bits first."""
    width = 16 if unit == mx.uint16 else 8
    attribute = f"_tqbatch_table_{width}"
    table = getattr(codec, attribute, None)
    if table is None:
        # Every cache builds codecs of its own, but of a few codebooks (one per
        # width and head dim): a table is built once per codebook's values.
        values = codec.codebook
        key = (width, codec.bits, str(values.dtype), np.array(values.astype(mx.float32)).tobytes())
        table = _TABLES.get(key)
        if table is None:
            shifts = np.arange(width // codec.bits) * codec.bits
            codes = (np.arange(2**width)[:, None] >> shifts) & ((1 << codec.bits) - 1)
            table = mx.take(values, mx.array(codes.astype(np.int32)), axis=0)
            mx.eval(table)
            _TABLES[key] = table
        setattr(codec, attribute, table)
    return table


# (width, bits, codebook dtype, codebook values) -> lookup table; see _lookup_table.
_TABLES: dict[tuple, mx.array] = {}


def dequantize(codec, state) -> mx.array:
    """``codec.dequantize(state)``: float32 tokens, through the codec's inverse rotation."""
    if not covers(codec):
        with mlx_vlm_follows_device():
            return codec.dequantize(state)
    return dequantize_plain(codec, state)


def dequantize_plain(codec, state: TurboQuantMSEState) -> mx.array:
    """``dequantize`` in these plain ops on any device; ``codec`` must be ``servable``."""
    unit = codec._rotate_inverse(_unit_codebook_vectors(codec, state))
    return state.norms[..., None].astype(unit.dtype) * unit


def attend(
    queries: mx.array,
    keys: TurboQuantMSEState,
    values: TurboQuantMSEState,
    key_codec,
    value_codec,
    scale: float,
    mask=None,
) -> mx.array | None:
    """Softmax attention of (B, Hq, L, D) queries over packed keys and values.

    Computed in the codecs' rotated bases, never dequantizing a token: the
    scaled query is rotated once into the key basis and scored against each
    key's codebook vector times its norm; the softmax weights times the value
    norms sum the value codebook vectors, rotated back once. ``mask``: None,
    ``"causal"``, a ``CausalRows`` (left-padded causal rows as numbers), or
    a boolean or additive array broadcastable to (B, Hq, L, T). Returns
    (B, Hq, L, Dv) in the queries' dtype, or None where the codecs or states
    are not served here (the caller falls back). A ``CausalRows`` mask for
    another number of keys raises ValueError on either path.
    """
    if isinstance(mask, CausalRows) and isinstance(keys, TurboQuantMSEState):
        mask.check_keys(queries.shape[2], keys.norms.shape[2])
    if not (covers(key_codec) and covers(value_codec)):
        return None
    if not (isinstance(keys, TurboQuantMSEState) and isinstance(values, TurboQuantMSEState)):
        return None
    return attend_plain(queries, keys, values, key_codec, value_codec, scale, mask)


def attend_plain(
    queries: mx.array,
    keys: TurboQuantMSEState,
    values: TurboQuantMSEState,
    key_codec,
    value_codec,
    scale: float,
    mask=None,
) -> mx.array:
    """``attend`` in these plain ops on any device: ``servable`` codecs, MSE states."""
    B, n_q, L, D = queries.shape
    n_kv, T = keys.norms.shape[1], keys.norms.shape[2]
    group = n_q // n_kv
    q = (queries * scale).astype(mx.float32).reshape(B, n_kv, group * L, D)
    q = key_codec._rotate_forward(q)
    k = _unit_codebook_vectors(key_codec, keys)  # (B, Hkv, T, D)
    scores = (q @ k.swapaxes(-1, -2)) * keys.norms.astype(mx.float32)[:, :, None, :]
    scores = scores.reshape(B, n_kv, group, L, T)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention mask {mask!r}: only 'causal' is a named mask")
        mask = mx.arange(T)[None] <= (mx.arange(L)[:, None] + (T - L))
    elif isinstance(mask, CausalRows):
        mask.check_keys(L, T)
        mask = mask.allowed(L)
    if mask is not None:
        mask = _grouped(mask, n_kv, group)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
        else:
            scores = scores + mask.astype(mx.float32)
    weights = mx.softmax(scores, axis=-1, precise=True).reshape(B, n_kv, group * L, T)
    weights = weights * values.norms.astype(mx.float32)[:, :, None, :]
    out = weights @ _unit_codebook_vectors(value_codec, values)  # (B, Hkv, group*L, Dv)
    out = value_codec._rotate_inverse(out)
    return out.reshape(B, n_q, L, -1).astype(queries.dtype)


def _grouped(mask: mx.array, n_kv: int, group: int) -> mx.array:
    """A mask broadcastable to (B, Hq, L, T), as one broadcastable to (B, Hkv, group, L, T)."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], n_kv, group, *mask.shape[2:])
