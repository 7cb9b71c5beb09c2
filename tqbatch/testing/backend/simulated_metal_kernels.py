"""What mlx-vlm's TurboQuant Metal kernels compute, in plain MLX ops: a simulated Mac's "pass".

``tqbatch.testing.backend.simulated_metal`` answers a kernel launch in mode ``pass``
with the emulation :func:`find` returns for the kernel's ``name=`` (mlx-vlm
0.7.10's builders in ``mlx_vlm/turboquant.py`` put their parameters in the
name: ``turboquant_norot_quantize_4``, ``turboquant_mse_score_tiled_2``...).
Each emulation is called as ``emulate(inputs, template, grid, threadgroup,
output_shapes, output_dtypes, init_value)``, ``inputs`` a dict from the
kernel's input names to arrays, ``template`` a dict of its template arguments,
and returns the outputs MLX would: same shapes, same dtypes.

An emulation reads its inputs as the Metal source does: each input as the flat
row-contiguous buffer MLX hands the kernel (``ensure_row_contiguous``), viewed
at the layout the source indexes; codes unpacked from 32-bit words least
significant bit first (the byte-wise extraction of the fused decode kernels
reads the same bits for widths up to 8); float32 arithmetic, the float16 norms
widened first. What it does not reproduce: the order of the kernels' float32
sums (simd_sum, per-lane partial sums) and Metal's fast-math ``exp``, so
results agree with a real GPU's to rounding, not bit for bit; threadgroup
memory a kernel reads without writing (the fused key+value quantizer sums 8
simdgroups' partial norms, fewer than 8 exist below 256 dimensions) is taken
as zero. Codes and packed words are exact.

Imports mlx: imported by the simulator at a kernel's first "pass" launch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import mlx.core as mx
import numpy as np

__all__ = ["emulated", "find"]

_EMULATIONS: list[tuple[re.Pattern, Callable]] = []


def _emulates(pattern: str):
    """Register an emulation for kernel names matching ``pattern`` (its groups: int parameters)."""

    def register(function):
        _EMULATIONS.append((re.compile(pattern), function))
        return function

    return register


def find(name: str) -> Callable | None:
    """The emulation of the kernel named ``name`` (parameters bound), or None."""
    for pattern, function in _EMULATIONS:
        found = pattern.fullmatch(name)
        if found:
            parameters = {key: int(value) for key, value in found.groupdict().items()}
            return functools.partial(function, **parameters)
    return None


def emulated() -> list[str]:
    """The name patterns of every emulated kernel."""
    return [pattern.pattern for pattern, _ in _EMULATIONS]


# ------------------------------------------------------------------ shared pieces


def _view(x: mx.array, *shape: int) -> mx.array:
    """The flat buffer of ``x`` at the layout a kernel indexes (sizes must agree)."""
    return x.reshape(-1).reshape(shape)


def _unpack(packed: mx.array, bits: int, length: int) -> mx.array:
    """(..., W) uint32 words -> (..., length) uint32 codes, as every kernel extracts them.

    Code ``i`` starts at bit ``i * bits`` of the row, least significant first;
    one that crosses a word takes its high bits from the next word.
    """
    index = np.arange(length)
    word, offset = np.divmod(index * bits, 32)
    spill = offset + bits - 32
    width = packed.shape[-1]
    low = mx.take(packed, mx.array(word.astype(np.int32)), axis=-1) >> mx.array(
        offset.astype(np.uint32)
    )
    following = mx.array(np.minimum(word + 1, width - 1).astype(np.int32))
    high = mx.take(packed, following, axis=-1) << mx.array(
        np.where(spill > 0, bits - spill, 0).astype(np.uint32)
    )
    codes = mx.where(mx.array(spill > 0), low | high, low)
    return codes & mx.array((1 << bits) - 1, dtype=mx.uint32)


def _pack(codes: mx.array, bits: int, width: int) -> mx.array:
    """(N, L) codes -> (N, width) uint32 words: the inverse of :func:`_unpack`.

    Words no code reaches stay zero.
    """
    values = np.array(codes.astype(mx.uint32)).astype(np.uint64) & ((1 << bits) - 1)
    words = np.zeros((values.shape[0], width), dtype=np.uint64)
    for i in range(values.shape[1]):
        word, offset = divmod(i * bits, 32)
        if word < width:
            words[:, word] |= (values[:, i] << np.uint64(offset)) & np.uint64(0xFFFFFFFF)
        if offset + bits > 32 and word + 1 < width:
            words[:, word + 1] |= values[:, i] >> np.uint64(32 - offset)
    return mx.array(words.astype(np.uint32))


def _quantized(values: mx.array, midpoints: mx.array, count: int) -> mx.array:
    """Codes by comparison: how many of the first ``count`` midpoints each value exceeds."""
    if count == 0:
        return mx.zeros(values.shape, dtype=mx.uint32)
    mids = midpoints.reshape(-1)[:count].astype(mx.float32)
    return mx.sum(values[..., None] > mids, axis=-1).astype(mx.uint32)


def _dequantized(packed, norms, codebook, bits: int, dim: int, heads: int, tokens: int):
    """(BH, T, D) float32 ``norm * codebook[code]`` and (BH, T, D) codebook values."""
    codes = _unpack(_view(packed, heads, tokens, packed.shape[-1]), bits, dim)
    values = mx.take(codebook.reshape(-1).astype(mx.float32), codes.astype(mx.int32))
    scale = _view(norms, heads, tokens).astype(mx.float32)[..., None]
    return values * scale, values


def _layout(norms: mx.array) -> tuple[int, int]:
    """(B * H, T) from a (B, H, T) norms input, as the kernels read ``norms_shape``."""
    return norms.shape[0] * norms.shape[1], norms.shape[2]


# ------------------------------------------------------------------ packing


@_emulates(r"turboquant_pack_lowbit")
def _pack_lowbit(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value):
    rows = inputs["values"].shape[0]
    values = _view(inputs["values"], rows, template["Length"])
    return [_pack(values, template["Bits"], template["PackedWidth"])]


@_emulates(r"turboquant_unpack_lowbit")
def _unpack_lowbit(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value):
    rows = inputs["packed"].shape[0]
    packed = _view(inputs["packed"], rows, template["PackedWidth"])
    return [_unpack(packed, template["Bits"], template["Length"])]


# ------------------------------------------------------------------ quantizers


@_emulates(r"turboquant_norot_quantize_(?P<bits>\d+)")
def _norot_quantize(
    inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value, *, bits
):
    dim, width = template["Dim"], template["PackedWidth"]
    rows = output_shapes[0][0]
    rotated = _view(inputs["rotated"], rows, dim).astype(mx.float32)
    codes = _quantized(rotated, inputs["midpoints"], (1 << bits) - 1)
    return [_pack(codes, bits, width)]


@_emulates(r"turboquant_fused_kv_quantize_k(?P<key_bits>\d+)_v(?P<val_bits>\d+)")
def _fused_kv_quantize(
    inputs,
    template,
    grid,
    threadgroup,
    output_shapes,
    output_dtypes,
    init_value,
    *,
    key_bits,
    val_bits,
):
    dim = template["Dim"]
    rows = output_shapes[0][0]
    outputs = []
    for side, bits, width in (
        ("key", key_bits, template["KPackedWidth"]),
        ("val", val_bits, template["VPackedWidth"]),
    ):
        vectors = _view(inputs[f"{side}_vectors"], rows, dim).astype(mx.float32)
        norm = mx.sqrt(mx.sum(vectors * vectors, axis=-1))
        inverse = mx.where(norm > 1e-10, 1.0 / norm, 0.0)
        # Row d of the rotation dotted with the unit vector: unit @ rotation.T.
        rotation = _view(inputs[f"{side}_rotation"], dim, dim).astype(mx.float32)
        rotated = (vectors * inverse[:, None]) @ rotation.T
        codes = _quantized(rotated, inputs[f"{side}_midpoints"], (1 << bits) - 1)
        outputs += [norm.astype(mx.float16), _pack(codes, bits, width)]
    return outputs


# ------------------------------------------------------------------ scores


def _scores(inputs, template, repeat: int) -> mx.array:
    """(BH, R, T) ``norm * <q, codebook[codes]>``, queries (BH * R, D) in the rotated basis."""
    norms, dim = inputs["norms"], template["Dim"]
    heads, tokens = _layout(norms)
    _, values = _dequantized(
        inputs["packed"], norms, inputs["codebook"], template["Bits"], dim, heads, tokens
    )
    q = _view(inputs["q_rot"], heads, repeat, dim).astype(mx.float32)
    dots = q @ values.transpose(0, 2, 1)
    return dots * _view(norms, heads, tokens).astype(mx.float32)[:, None, :]


@_emulates(r"turboquant_mse_score")
def _mse_score(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value):
    scores = _scores(inputs, template, inputs["q_rot"].shape[2])
    return [scores.reshape(output_shapes[0])]


@_emulates(r"turboquant_mse_score_tiled_(?P<repeat>\d+)")
def _mse_score_tiled(
    inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value, *, repeat
):
    scores = _scores(inputs, template, template["RepeatCount"])
    return [scores.reshape(output_shapes[0])]


# ------------------------------------------------------------------ weighted sums


def _weighted_rot(weights, inputs, template) -> mx.array:
    """(BH, R, D) ``sum_t weight * norm * codebook[code]``: values in the rotated basis."""
    norms = inputs["norms"]
    heads, tokens = _layout(norms)
    scaled, _ = _dequantized(
        inputs["packed"],
        norms,
        inputs["codebook"],
        template["Bits"],
        template["Dim"],
        heads,
        tokens,
    )
    return _view(weights, heads, -1, tokens).astype(mx.float32) @ scaled


@_emulates(r"turboquant_mse_weighted_rot")
def _mse_weighted_rot(
    inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value
):
    return [_weighted_rot(inputs["weights"], inputs, template).reshape(output_shapes[0])]


@_emulates(r"turboquant_mse_weighted_rot_repeat_(?P<repeat>\d+)")
def _mse_weighted_rot_repeat(
    inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value, *, repeat
):
    return _mse_weighted_rot(
        inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value
    )


def _softmax_weighted_rot(inputs, template) -> tuple[mx.array, mx.array]:
    """(BH, R, T) ``exp(score - max_score)`` with the max the caller passed, and those
    numerators' weighted sum of the values, (BH, R, D) in the rotated basis."""
    heads, tokens = _layout(inputs["norms"])
    scores = _view(inputs["scores"], heads, -1, tokens).astype(mx.float32)
    top = _view(inputs["max_scores"], heads, scores.shape[1]).astype(mx.float32)
    numerators = mx.exp(scores - top[..., None])
    return numerators, _weighted_rot(numerators, inputs, template)


@_emulates(r"turboquant_mse_scores_weighted_rot_sum_repeat_(?P<repeat>\d+)")
def _mse_scores_weighted_rot_sum(
    inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value, *, repeat
):
    _, out = _softmax_weighted_rot(inputs, template)
    return [out.reshape(output_shapes[0])]


@_emulates(r"turboquant_mse_scores_weighted_rot_repeat_(?P<repeat>\d+)")
def _mse_scores_weighted_rot(
    inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value, *, repeat
):
    numerators, out = _softmax_weighted_rot(inputs, template)
    denominator = mx.maximum(mx.sum(numerators, axis=-1), 1e-6)
    return [(out / denominator[..., None]).reshape(output_shapes[0])]


@_emulates(r"turboquant_single_tile_value_(?P<bits>\d+)_r(?P<repeat>\d+)")
def _single_tile_value(
    inputs,
    template,
    grid,
    threadgroup,
    output_shapes,
    output_dtypes,
    init_value,
    *,
    bits,
    repeat,
):
    dim, tile = template["Dim"], template["TokTileSize"]
    heads, tokens = _layout(inputs["norms"])
    tiles = -(-tokens // tile)
    scaled, _ = _dequantized(
        inputs["packed"], inputs["norms"], inputs["codebook"], bits, dim, heads, tokens
    )
    weights = _view(inputs["weights"], heads, repeat, tokens).astype(mx.float32)
    # One partial sum per tile of TokTileSize tokens; the caller adds them up.
    padding = tiles * tile - tokens
    weights = mx.pad(weights, [(0, 0), (0, 0), (0, padding)]).reshape(heads, repeat, tiles, tile)
    scaled = mx.pad(scaled, [(0, 0), (0, padding), (0, 0)]).reshape(heads, tiles, tile, dim)
    partial = weights.transpose(0, 2, 1, 3) @ scaled  # (BH, tiles, R, D)
    return [partial.reshape(output_shapes[0])]


# ------------------------------------------------------------------ fused decode


def _decode_scores_and_values(inputs, template, key_bits: int, val_bits: int):
    """Per query head: (BQH, T) scores and (BQH, T, D) ``norm * codebook[code]`` values.

    Query head ``bqh`` attends to KV head ``bqh / RepeatCount``; its query
    is already scaled and rotated (the caller prepares it).
    """
    dim, repeat = template["Dim"], template["RepeatCount"]
    heads, tokens = _layout(inputs["key_norms"])
    queries = _view(inputs["queries"], heads, repeat, dim).astype(mx.float32)
    _, keys = _dequantized(
        inputs["key_packed"],
        inputs["key_norms"],
        inputs["key_codebook"],
        key_bits,
        dim,
        heads,
        tokens,
    )
    key_norms = _view(inputs["key_norms"], heads, tokens).astype(mx.float32)
    scores = (queries @ keys.transpose(0, 2, 1)) * key_norms[:, None, :]
    values, _ = _dequantized(
        inputs["val_packed"],
        inputs["val_norms"],
        inputs["val_codebook"],
        val_bits,
        dim,
        heads,
        tokens,
    )
    return scores.reshape(heads * repeat, tokens), values, repeat


@_emulates(r"turboquant_fused_mse_sdpa_k(?P<key_bits>\d+)_v(?P<val_bits>\d+)_d(?P<dim>\d+)")
def _fused_mse_sdpa(
    inputs,
    template,
    grid,
    threadgroup,
    output_shapes,
    output_dtypes,
    init_value,
    *,
    key_bits,
    val_bits,
    dim,
):
    scores, values, repeat = _decode_scores_and_values(inputs, template, key_bits, val_bits)
    heads = values.shape[0]
    if scores.shape[-1] == 0:
        # No token: the kernel's total is NaN or 0, and it writes 0 for either.
        return [mx.zeros(output_shapes[0], dtype=mx.float32)]
    top = mx.max(scores, axis=-1, keepdims=True)
    numerators = mx.exp(scores - top).reshape(heads, repeat, -1)
    total = mx.sum(numerators, axis=-1, keepdims=True)
    out = (numerators @ values) / total
    out = mx.where(total > 0, out, 0.0)
    return [out.reshape(output_shapes[0])]


@_emulates(r"turboquant_mse_sdpa_2pass1_k(?P<key_bits>\d+)_v(?P<val_bits>\d+)_d(?P<dim>\d+)")
def _mse_sdpa_pass1(
    inputs,
    template,
    grid,
    threadgroup,
    output_shapes,
    output_dtypes,
    init_value,
    *,
    key_bits,
    val_bits,
    dim,
):
    scores, values, repeat = _decode_scores_and_values(inputs, template, key_bits, val_bits)
    blocks = template["Blocks"]
    heads, tokens, _ = values.shape
    # Block b takes tokens b, b + Blocks, b + 2 Blocks...: token j * Blocks + b.
    rounds = -(-tokens // blocks)
    padding = rounds * blocks - tokens
    valid = mx.array(np.arange(rounds * blocks).reshape(rounds, blocks) < tokens)
    scores = mx.pad(scores, [(0, 0), (0, padding)], constant_values=-np.inf)
    scores = scores.reshape(-1, rounds, blocks)
    top = mx.max(scores, axis=1)  # (BQH, Blocks); -inf for a block without tokens
    finite_top = mx.where(mx.isinf(top), 0.0, top)
    numerators = mx.where(valid, mx.exp(scores - finite_top[:, None, :]), 0.0)
    sums = mx.sum(numerators, axis=1)
    values = mx.pad(values, [(0, 0), (0, padding), (0, 0)]).reshape(heads, rounds, blocks, -1)
    values = mx.repeat(values, repeat, axis=0)  # query head bqh reads KV head bqh / R
    acc = mx.sum(numerators[..., None] * values, axis=1)  # (BQH, Blocks, D)
    return [
        acc.reshape(output_shapes[0]),
        sums.reshape(output_shapes[1]),
        top.reshape(output_shapes[2]),
    ]


@_emulates(r"turboquant_mse_sdpa_2pass2")
def _mse_sdpa_pass2(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value):
    dim, blocks = template["Dim"], template["Blocks"]
    heads = output_shapes[0][0]
    partials = _view(inputs["partials"], heads, blocks, dim).astype(mx.float32)
    sums = _view(inputs["sums"], heads, blocks).astype(mx.float32)
    maxs = _view(inputs["maxs"], heads, blocks).astype(mx.float32)
    top = mx.max(maxs, axis=-1, keepdims=True)
    factors = mx.where(mx.isinf(maxs), 0.0, mx.exp(maxs - mx.where(mx.isinf(top), 0.0, top)))
    total = mx.sum(sums * factors, axis=-1, keepdims=True)
    out = mx.sum(partials * factors[..., None], axis=1) / total
    # Simdgroup g folds blocks g, g + 32...: one whose first block saw no token
    # starts from exp(-inf - -inf) = NaN, so the total is NaN and the kernel
    # writes 0 (mlx-vlm launches it with more tokens than blocks).
    poisoned = mx.any(mx.isinf(maxs[:, : min(32, blocks)]), axis=-1, keepdims=True)
    out = mx.where((total > 0) & ~poisoned, out, 0.0)
    return [out.reshape(output_shapes[0])]
