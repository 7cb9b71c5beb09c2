"""mlx-vlm's off-Metal fallback, vectorized, for the single-request caches the harness handles.

The harness writes and reads mlx-vlm ``TurboQuantKVCache``s of its own: the
members a ``merge`` op hands to the target (prefilled through the cache's
own ``update_and_fetch``) and the single caches an ``extract`` returns
(read back with ``dequantize``, written with a poison token). Off Metal,
mlx-vlm's codec packs and unpacks codes with a Python loop over the
coordinates, a scatter each (``_pack_lowbit``, ``_unpack_lowbit``), and
finds each coordinate's code with a comparison per codebook midpoint
(``_TurboQuantMSECodec._quantize_unit``): most of what building a member
costs. The packed form is a little-endian bit stream (code ``i``'s bit
``j`` is bit ``i * bits + j`` of the row), so both packing directions are a
few whole-array ops, and the code search is a binary search over the
ascending midpoints (``tqbatch.testing.oracles.code_search``).

``vectorized_fallback()`` puts these in place of mlx-vlm's three for the
duration of a ``with`` block and only there: the target's own calls
(mlx-vlm's class as a target packs through the same module) never run
inside one. Where mlx-vlm's Metal gate is open its kernels do the work,
and nothing is replaced. ``tests/unit/test_vectorized_fallback.py`` shows
them equal to mlx-vlm's, bit for bit, at every width and length the
harness uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import mlx.core as mx
from mlx_vlm import turboquant
from mlx_vlm.turboquant import _TurboQuantMSECodec

from tqbatch.testing.oracles.code_search import midpoints_below

__all__ = ["pack_lowbit", "quantize_unit", "unpack_lowbit", "vectorized_fallback"]


def pack_lowbit(values: mx.array, bits: int) -> mx.array:
    """``mlx_vlm.turboquant._pack_lowbit``: codes (..., L) below ``2**bits`` into uint32 words."""
    if bits == 0:
        return mx.zeros((*values.shape[:-1], 0), dtype=mx.uint32)
    length = values.shape[-1]
    width = (length * bits + 31) // 32
    codes = values.astype(mx.uint32).reshape((-1, length))
    shifts = mx.arange(bits, dtype=mx.uint32)
    stream = ((codes[..., None] >> shifts) & 1).reshape((codes.shape[0], length * bits))
    stream = mx.pad(stream, [(0, 0), (0, width * 32 - length * bits)])
    words = stream.reshape((codes.shape[0], width, 32)) << mx.arange(32, dtype=mx.uint32)
    # Distinct powers of two: the sum is the bitwise or, and stays below 2**32.
    packed = mx.sum(words, axis=-1).astype(mx.uint32)
    return packed.reshape((*values.shape[:-1], width))


def unpack_lowbit(packed: mx.array, bits: int, length: int) -> mx.array:
    """``mlx_vlm.turboquant._unpack_lowbit``: ``length`` codes of ``bits`` out of uint32 words."""
    if bits == 0:
        return mx.zeros((*packed.shape[:-1], 0), dtype=mx.uint32)
    words = packed.astype(mx.uint32).reshape((-1, packed.shape[-1]))
    stream = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    stream = stream.reshape((words.shape[0], words.shape[1] * 32))[:, : length * bits]
    bits_of = stream.reshape((words.shape[0], length, bits)) << mx.arange(bits, dtype=mx.uint32)
    codes = mx.sum(bits_of, axis=-1).astype(mx.uint32)
    return codes.reshape((*packed.shape[:-1], length))


def quantize_unit(codec, unit_vectors: mx.array) -> mx.array:
    """``_TurboQuantMSECodec._quantize_unit``: the packed codes of (..., D) unit vectors."""
    if codec.bits == 0:
        return mx.zeros((*unit_vectors.shape[:-1], 0), dtype=mx.uint32)
    rotated = codec._rotate_forward(unit_vectors)
    return pack_lowbit(midpoints_below(codec._midpoints, rotated), codec.bits)


@contextlib.contextmanager
def vectorized_fallback() -> Iterator[None]:
    """mlx-vlm packs, unpacks and searches codes with ``pack_lowbit``, ``unpack_lowbit``
    and ``quantize_unit`` inside the block.

    Off Metal only (mlx-vlm's kernels do the work there). A packed row too
    short for the codes asked of it goes to mlx-vlm's own loop, so that
    whatever it makes of a malformed state is what the harness sees.
    """
    if turboquant._metal_available():
        yield
        return
    mlx_vlm_unpack = turboquant._unpack_lowbit

    def unpack(packed, bits, length):
        if bits and packed.shape[-1] * 32 < length * bits:
            return mlx_vlm_unpack(packed, bits, length)
        return unpack_lowbit(packed, bits, length)

    with (
        mock.patch.object(turboquant, "_pack_lowbit", pack_lowbit),
        mock.patch.object(turboquant, "_unpack_lowbit", unpack),
        mock.patch.object(_TurboQuantMSECodec, "_quantize_unit", quantize_unit),
    ):
        yield
