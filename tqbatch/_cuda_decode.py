"""A decode step's attention over packed TurboQuant states in two CUDA kernels.

The vectorized path (``_codec.attend_plain``) is about a hundred small MLX
kernels per layer and step, which on an NVIDIA GPU is launch-bound. Here a
decode step (one query per row) is: the query scaled and rotated into the key
basis by the codec's own ops (as ``attend_plain`` does), one fused kernel that
reads each KV head's packed codes once for all of its query heads, scoring
keys as ``norm * <q, codebook[code]>`` and accumulating values in the rotated
basis under an online softmax, one small kernel that merges the token splits,
and the codec's inverse rotation, once.

``mode()`` says which path a decode step takes (``TQBATCH_DECODE_KERNEL``,
read at each call: ``auto`` takes the kernel where MLX's default
device is a CUDA GPU and the step is one ``supports`` accepts (the default),
``fused`` takes it wherever it is supported and raises elsewhere, ``vectorized``
never takes it. On a CPU or a Mac's GPU (Metal) ``available`` is false and
nothing here runs, whatever the mode.
``supports`` is the shape and codec gate; ``attend`` returns None where the
kernel is not taken, so the caller keeps its path.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
from mlx_vlm.turboquant import TurboQuantMSEState

from tqbatch import _codec
from tqbatch._masks import CausalRows

__all__ = ["MODES", "attend", "available", "mode", "supports"]

MODES = ("auto", "fused", "vectorized")
_ENV = "TQBATCH_DECODE_KERNEL"
# The kernel wherever it runs: on an H100 the equivalence property holds at float32
# and TF32, and the suite's verdicts with it on are those with it off at both
# precisions (docs/gpu.md, "Fused CUDA decode").
_DEFAULT = "auto"

# Threads per block, and tokens per tile: one token per thread while scoring,
# one value coordinate per thread while accumulating (so value dims <= 128).
_THREADS = 128
_MAX_DIM = 128
_MAX_GROUP = 8  # query heads per KV head: that many accumulators per thread
# Splits of the token axis aim at this many blocks in all (two waves of an
# H200's 132 SMs), each split at least one tile.
_TARGET_BLOCKS = 264


def mode() -> str:
    """``TQBATCH_DECODE_KERNEL`` (read now): auto (default), fused or vectorized."""
    value = os.environ.get(_ENV, _DEFAULT).strip().lower() or _DEFAULT
    if value not in MODES:
        raise ValueError(f"{_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def available() -> bool:
    """Whether MLX's default device is a CUDA GPU (the only place the kernel runs)."""
    return (
        hasattr(mx, "cuda")
        and mx.cuda.is_available()
        and mx.default_device().type == mx.DeviceType.gpu
    )


def supports(queries, keys, values, key_codec, value_codec, mask) -> bool:
    """Whether the kernel computes this step: one query per row, integer-bit MSE states,
    dims <= 128, at most 8 query heads per KV head, and no mask or the cache's own
    left-padded causal rows (no window)."""
    if not (_codec.servable(key_codec) and _codec.servable(value_codec)):
        return False
    if not (isinstance(keys, TurboQuantMSEState) and isinstance(values, TurboQuantMSEState)):
        return False
    if queries.ndim != 4 or queries.shape[2] != 1:
        return False
    B, n_q, _, dim = queries.shape
    n_kv, T = keys.norms.shape[1], keys.norms.shape[2]
    if T < 1 or n_kv < 1 or n_q % n_kv or n_q // n_kv > _MAX_GROUP:
        return False
    if dim != key_codec.dim or dim > _MAX_DIM or value_codec.dim > _MAX_DIM:
        return False
    if keys.norms.shape[0] != B or values.norms.shape != keys.norms.shape:
        return False
    for state, codec in ((keys, key_codec), (values, value_codec)):
        if state.indices.ndim != 4 or state.indices.dtype != mx.uint32:
            return False
        if state.indices.shape[3] != -(-codec.dim * codec.bits // 32):
            return False
    if mask is None:
        return True
    return isinstance(mask, CausalRows) and mask.window is None and mask.offset + 1 == T


def attend(queries, keys, values, key_codec, value_codec, scale, mask=None):
    """The fused decode attention, or None where ``mode()`` and ``supports`` say not here.

    Same contract as ``_codec.attend`` for (B, Hq, 1, D) queries; raises under
    ``fused`` where the kernel cannot run.
    """
    chosen = mode()
    if chosen == "vectorized":
        return None
    ok = supports(queries, keys, values, key_codec, value_codec, mask)
    if chosen == "fused" and not (ok and available()):
        where = "this device" if ok else "this step's shapes, codecs or mask"
        raise RuntimeError(f"{_ENV}=fused: the fused CUDA decode kernel does not serve {where}")
    if not (ok and available()):
        return None
    return _fused(queries, keys, values, key_codec, value_codec, scale, mask)


def _splits(rows: int, tokens: int) -> int:
    tiles = -(-tokens // _THREADS)
    return max(1, min(tiles, -(-_TARGET_BLOCKS // rows)))


def _fused(queries, keys, values, key_codec, value_codec, scale, mask):
    B, n_q, _, dim = queries.shape
    n_kv, T = keys.norms.shape[1], keys.norms.shape[2]
    group, dv = n_q // n_kv, value_codec.dim
    # The query as attend_plain makes it: scaled in its dtype, float32, rotated.
    q = (queries * scale).astype(mx.float32).reshape(B, n_kv, group, dim)
    q = key_codec._rotate_forward(q)
    starts = mx.zeros((B,), mx.int32) if mask is None else mask.starts.astype(mx.int32).reshape(B)
    splits = _splits(B * n_kv, T)
    consts = [
        ("DK", dim),
        ("DV", dv),
        ("KB", key_codec.bits),
        ("VB", value_codec.bits),
        ("G", group),
        ("NT", _THREADS),
    ]
    acc, top, wsum = _partial_kernel()(
        inputs=[
            q,
            keys.indices,
            keys.norms,
            values.indices,
            values.norms,
            key_codec.codebook.astype(mx.float32),
            value_codec.codebook.astype(mx.float32),
            starts,
        ],
        template=consts,
        grid=(splits * _THREADS, n_kv, B),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[
            (B, n_kv, group, splits, dv),
            (B, n_kv, group, splits),
            (B, n_kv, group, splits),
        ],
        output_dtypes=[mx.float32] * 3,
    )
    rows = B * n_kv * group
    width = 32 * -(-dv // 32)
    (out,) = _combine_kernel()(
        inputs=[acc, top, wsum],
        template=[("DV", dv), ("S", splits)],
        grid=(rows * width, 1, 1),
        threadgroup=(width, 1, 1),
        output_shapes=[(B, n_kv, group, dv)],
        output_dtypes=[mx.float32],
    )
    out = value_codec._rotate_inverse(out)
    return out.reshape(B, n_q, 1, dv).astype(queries.dtype)


# Code i of a packed row sits at bits [i*b, i*b + b) of the row's little-endian
# uint32 words and may spill into the next word (_codec's layout). With the
# dims and bits compile-time constants, every word index and shift below folds
# to a constant and a key row's words live in registers.
_HEADER = r"""
// NVRTC has no math.h, so no INFINITY macro: -inf from its bits.
#define TQ_NEG_INF (-__int_as_float(0x7f800000))

template <int BITS>
__device__ __forceinline__ uint32_t tq_code(const uint32_t* words, int i) {
  const int bit = i * BITS;
  const int w = bit >> 5, off = bit & 31;
  uint32_t x = words[w] >> off;
  if (off + BITS > 32) x |= words[w + 1] << (32 - off);
  return x & ((1u << BITS) - 1u);
}

// Norms are float16 as the codec stores them, or float32.
__device__ __forceinline__ float tq_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float tq_float(float x) { return x; }

__device__ __forceinline__ float tq_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float tq_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
"""

# One block per (token split, KV head, row). Memory layout it reads: q
# (B, Hkv, G, DK) float32 rotated and scaled; codes (B, Hkv, T, W) uint32 and
# norms (B, Hkv, T) float16, both addressed through their strides, because the
# cache hands over a token slice of a larger buffer and a copy would cost a
# whole cache read per step. Per 128-token tile: the block copies the tile's
# packed value rows to shared memory (coalesced: adjacent threads, adjacent
# words; in flight during the scoring), each thread scores one token for all G
# heads (its key row's words in registers, codebook and query in shared
# memory), the block takes each head's tile max (online softmax), each thread
# turns its scores into weights, then each thread owns one value coordinate and
# sums weight * value-norm * codebook over the tile's tokens from shared memory.
# Outputs per (row, head, query head, split): the unnormalized rotated
# accumulator, the running max and the weight sum.
_PARTIAL = r"""
  constexpr int WK = (DK * KB + 31) / 32;
  constexpr int WV = (DV * VB + 31) / 32;
  constexpr int NW = NT / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int S = gridDim.x, H = gridDim.y;
  const int T = kn_shape[2];

  __shared__ float q_s[G][DK];
  __shared__ float kcb_s[1 << KB];
  __shared__ float vcb_s[1 << VB];
  __shared__ float p_s[G][NT];
  __shared__ uint32_t v_s[NT][WV];  // the tile's packed value rows (<= 16 kB)
  __shared__ float m_s[G];
  __shared__ float alpha_s[G];
  __shared__ float red_s[G][NW];

  for (int i = tid; i < G * DK; i += NT) {
    const int g = i / DK, d = i % DK;
    q_s[g][d] = q[b * q_strides[0] + h * q_strides[1] + g * q_strides[2] + d * q_strides[3]];
  }
  for (int i = tid; i < (1 << KB); i += NT) kcb_s[i] = kcb[i];
  for (int i = tid; i < (1 << VB); i += NT) vcb_s[i] = vcb[i];
  if (tid < G) m_s[tid] = TQ_NEG_INF;

  // Live tokens of this split: the row's left padding is masked out; the
  // query's own token (T - 1) is always live.
  const int chunk = ((T + S - 1) / S + NT - 1) / NT * NT;
  int start = starts[b * starts_strides[0]];
  start = start < 0 ? 0 : (start > T - 1 ? T - 1 : start);
  // (Ternaries, not min/max: those overloads differ between NVRTC's headers.)
  const int lo = split * chunk > start ? split * chunk : start;
  const int hi = (split + 1) * chunk < T ? (split + 1) * chunk : T;

  const long kn_base = (long)b * kn_strides[0] + (long)h * kn_strides[1];
  const long kw_base = (long)b * kw_strides[0] + (long)h * kw_strides[1];
  const long vn_base = (long)b * vn_strides[0] + (long)h * vn_strides[1];
  const long vw_base = (long)b * vw_strides[0] + (long)h * vw_strides[1];

  // This thread's value coordinate: its word(s) and shift, fixed for the block.
  const int vbit = tid * VB;
  const int vword = vbit >> 5, voff = vbit & 31;
  const bool vspill = voff + VB > 32;

  float acc[G];
  float lsum[G];
  #pragma unroll
  for (int g = 0; g < G; ++g) { acc[g] = 0.f; lsum[g] = 0.f; }
  __syncthreads();

  for (int t0 = lo; t0 < hi; t0 += NT) {
    const int n = hi - t0 < NT ? hi - t0 : NT;
    // The tile's value rows into shared memory, all threads at once (adjacent
    // threads, adjacent words): these loads are in flight while the keys are scored.
    for (int i = tid; i < n * WV; i += NT) {
      const int j = i / WV, k = i - j * WV;
      v_s[j][k] = vw[vw_base + (long)(t0 + j) * vw_strides[2] + (long)k * vw_strides[3]];
    }
    // Scores: one token per thread.
    const int t = t0 + tid;
    const bool live = t < hi;
    float s[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0.f;
    if (live) {
      uint32_t w[WK];
      const long row = kw_base + (long)t * kw_strides[2];
      #pragma unroll
      for (int j = 0; j < WK; ++j) w[j] = kw[row + (long)j * kw_strides[3]];
      #pragma unroll
      for (int i = 0; i < DK; ++i) {
        const float c = kcb_s[tq_code<KB>(w, i)];
        #pragma unroll
        for (int g = 0; g < G; ++g) s[g] = fmaf(q_s[g][i], c, s[g]);
      }
      const float n = tq_float(kn[kn_base + (long)t * kn_strides[2]]);
      #pragma unroll
      for (int g = 0; g < G; ++g) s[g] *= n;
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) p_s[g][tid] = live ? s[g] : TQ_NEG_INF;
    __syncthreads();

    // Each head's tile max, then its new running max and the rescale factor.
    for (int g = warp; g < G; g += NW) {
      float v = TQ_NEG_INF;
      for (int j = lane; j < NT; j += 32) v = fmaxf(v, p_s[g][j]);
      v = tq_warp_max(v);
      if (lane == 0) {
        const float m_new = fmaxf(m_s[g], v);
        alpha_s[g] = expf(m_s[g] - m_new);
        m_s[g] = m_new;
      }
    }
    __syncthreads();

    // Weights; the value norm folds into the weight, the sum takes it bare.
    float vnorm = 0.f;
    if (live) vnorm = tq_float(vn[vn_base + (long)t * vn_strides[2]]);
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      const float p = live ? expf(s[g] - m_s[g]) : 0.f;
      lsum[g] = lsum[g] * alpha_s[g] + p;
      p_s[g][tid] = p * vnorm;
    }
    __syncthreads();

    // Values: one coordinate per thread, over the tile's tokens.
    if (tid < DV) {
      #pragma unroll
      for (int g = 0; g < G; ++g) acc[g] *= alpha_s[g];
      #pragma unroll 4
      for (int j = 0; j < n; ++j) {
        uint32_t x = v_s[j][vword] >> voff;
        if (vspill) x |= v_s[j][vword + 1] << (32 - voff);
        const float c = vcb_s[x & ((1u << VB) - 1u)];
        #pragma unroll
        for (int g = 0; g < G; ++g) acc[g] = fmaf(p_s[g][j], c, acc[g]);
      }
    }
    __syncthreads();
  }

  // Each head's weight sum: per-thread partial sums (all rescaled alike) added up.
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    const float v = tq_warp_sum(lsum[g]);
    if (lane == 0) red_s[g][warp] = v;
  }
  __syncthreads();
  const long out_row = (((long)b * H + h) * G) * S + split;  // (b, h, g=0, split)
  if (tid < G) {
    float v = 0.f;
    for (int k = 0; k < NW; ++k) v += red_s[tid][k];
    pl[out_row + (long)tid * S] = v;
    pm[out_row + (long)tid * S] = m_s[tid];
  }
  if (tid < DV) {
    #pragma unroll
    for (int g = 0; g < G; ++g) pacc[(out_row + (long)g * S) * DV + tid] = acc[g];
  }
"""

# One block per (row, KV head, query head), one thread per value coordinate:
# merge the splits' partial softmaxes (an empty split has max -inf, weight 0).
_COMBINE = r"""
  const int r = blockIdx.x, d = threadIdx.x;
  if (d >= DV) return;
  const float* m = pm + (long)r * S;
  const float* l = pl + (long)r * S;
  float top = TQ_NEG_INF;
  for (int s = 0; s < S; ++s) top = fmaxf(top, m[s]);
  float num = 0.f, den = 0.f;
  for (int s = 0; s < S; ++s) {
    const float w = m[s] == TQ_NEG_INF ? 0.f : expf(m[s] - top);
    num = fmaf(w, pacc[((long)r * S + s) * DV + d], num);
    den = fmaf(w, l[s], den);
  }
  out[(long)r * DV + d] = num / den;
"""


@functools.cache
def _partial_kernel():
    return mx.fast.cuda_kernel(
        name="tqbatch_decode_partial",
        input_names=["q", "kw", "kn", "vw", "vn", "kcb", "vcb", "starts"],
        output_names=["pacc", "pm", "pl"],
        source=_PARTIAL,
        header=_HEADER,
        # The packed states arrive as token slices of the cache's buffers:
        # read through strides, never copied.
        ensure_row_contiguous=False,
    )


@functools.cache
def _combine_kernel():
    return mx.fast.cuda_kernel(
        name="tqbatch_decode_combine",
        input_names=["pacc", "pm", "pl"],
        output_names=["out"],
        source=_COMBINE,
        header=_HEADER,  # TQ_NEG_INF: NVRTC has no INFINITY (seen failing on an H100)
    )
