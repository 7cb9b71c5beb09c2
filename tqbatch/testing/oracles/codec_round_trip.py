"""What an mlx-vlm codec gives back for tokens it quantized: ``dequantize(quantize(x))``.

The per-request references (``tqbatch.testing.oracles.reference``) hold tokens as a
``TurboQuantKVCache`` would read them back. Off Metal, mlx-vlm's
``_TurboQuantMSECodec`` quantizes and dequantizes in plain MLX ops whose
packing and unpacking are Python loops over the coordinates, a scatter per
coordinate (most of the harness's time per example). The round trip needs
no packed form: unpacking what was packed gives the codes back. So here,
the same steps as mlx-vlm's fallback, with its own rotations, codebook and
midpoints, without the packing: float32 norms, unit vectors, the codec's
forward rotation, the count of midpoints below each coordinate, the
codebook value of that code, the codec's inverse rotation, the norm rounded
to float16. ``tests/unit/test_codec_round_trip.py`` shows it equal, bit for
bit, to ``codec.dequantize(codec.quantize(x))`` at every width and head dim
the machine draws.

Where mlx-vlm would launch its Metal kernels (its gate open: Metal present
and not closed by the harness's CPU lane), the codec's own methods run, so
that the references read what mlx-vlm computes on that device.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm import turboquant
from mlx_vlm.turboquant import _EPS, _SplitCodec, _TurboQuantMSECodec

from tqbatch.testing.oracles.code_search import midpoints_below

__all__ = ["round_trip"]


def round_trip(codec, tokens: mx.array) -> mx.array:
    """``codec.dequantize(codec.quantize(tokens))`` for (..., D) tokens, lazily (not evaluated)."""
    if turboquant._metal_available() or not _plain(codec):
        return codec.dequantize(codec.quantize(tokens))
    if isinstance(codec, _SplitCodec):
        low = _mse_round_trip(codec.low_codec, mx.take(tokens, codec.low_idx, axis=-1))
        high = _mse_round_trip(codec.high_codec, mx.take(tokens, codec.high_idx, axis=-1))
        merged = mx.concatenate([low, high], axis=-1)
        return mx.take(merged, codec.restore_order, axis=-1)
    return _mse_round_trip(codec, tokens)


def _plain(codec) -> bool:
    """Whether ``codec`` is one whose steps this module repeats (an MSE codec, or a split of
    two); any other kind goes through its own methods."""
    if isinstance(codec, _SplitCodec):
        return all(_plain(c) for c in (codec.low_codec, codec.high_codec))
    return type(codec) is _TurboQuantMSECodec


def _mse_round_trip(codec, tokens: mx.array) -> mx.array:
    # _TurboQuantMSECodec.quantize's fallback: float16 norms of the float32
    # tokens, codes of the rotated unit vectors.
    x = tokens.astype(mx.float32)
    norms = mx.linalg.norm(x, axis=-1)
    if codec.bits == 0:
        unit = mx.zeros(x.shape[:-1] + (codec.dim,), dtype=mx.float32)
    else:
        rotated = codec._rotate_forward(x / mx.maximum(norms[..., None], _EPS))
        codes = midpoints_below(codec._midpoints, rotated)
        # _dequantize_unit: the codes' codebook values, rotated back.
        unit = codec._rotate_inverse(mx.take(codec.codebook, codes, axis=0))
    return norms.astype(mx.float16)[..., None].astype(unit.dtype) * unit
