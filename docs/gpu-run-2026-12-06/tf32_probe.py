"""Which rounding MLX's float32 matmuls apply on this device, at the decode step's shapes,
and how far the fused kernel is from the vectorized path with each rounding of its
matmul operands (TQBATCH_DECODE_TF32: "" none, rna nearest, rz truncation). The rounding
variants need the experiment's kernel, tf32-operand-rounding.diff here (not kept: without
it all three are the same kernel).

    python3 docs/gpu-run-2026-12-06/tf32_probe.py
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
from mlx_vlm.turboquant import _TurboQuantMSECodec

from tqbatch import _codec, _cuda_decode
from tqbatch._masks import CausalRows
from tqbatch.testing import backend


def rna(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32) + np.uint32(0x1000)
    return (u & np.uint32(0xFFFFE000)).view(np.float32)


def rz(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return (u & np.uint32(0xFFFFE000)).view(np.float32)


def matmul_rounding(B, H, M, D, N, rng):
    """|MLX a @ b - float64 reference| with each operand rounding, relative to |a||b|."""
    a = rng.standard_normal((B, H, M, D)).astype(np.float32)
    b = rng.standard_normal((B, H, D, N)).astype(np.float32)
    got = np.array(mx.array(a) @ mx.array(b)).astype(np.float64)
    scale = np.abs(a).max() * np.abs(b).max() * D
    out = {}
    for name, f in (("none", lambda x: x), ("rna", rna), ("rz", rz)):
        ref = f(a).astype(np.float64) @ f(b).astype(np.float64)
        out[name] = float(np.abs(got - ref).max() / scale)
    return out


def kernel_vs_vectorized(B, n_kv, group, dim, bits, T, seed):
    kc = _TurboQuantMSECodec(dim, bits, seed=1)
    vc = _TurboQuantMSECodec(dim, bits, seed=2)
    kk, kv = mx.random.split(mx.random.key(seed), 2)
    k = mx.random.normal((B, n_kv, T, dim), key=kk)
    v = mx.random.normal((B, n_kv, T, dim), key=kv)
    keys, values = _codec.quantize_plain(kc, k), _codec.quantize_plain(vc, v)
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((B, n_kv * group, 1, dim)).astype(np.float32))
    mask = CausalRows(mx.zeros((B,), mx.int32), T - 1)
    want = np.array(_codec.attend_plain(q, keys, values, kc, vc, dim**-0.5, mask))
    out = {}
    for name in ("", "rna", "rz"):
        os.environ["TQBATCH_DECODE_TF32"] = name
        got = np.array(_cuda_decode._fused(q, keys, values, kc, vc, dim**-0.5, mask))
        out[name or "none"] = float(np.abs(got - want).max())
    os.environ.pop("TQBATCH_DECODE_TF32")
    return out


def main():
    print("#", backend.describe_line(), flush=True)
    rng = np.random.default_rng(0)
    # scores q @ k^T: M = query heads per KV head; weights @ values: N = head dim.
    for B, H, M, D, N in [
        (1, 1, 2, 32, 20),
        (4, 2, 2, 32, 20),
        (4, 1, 2, 32, 20),
        (8, 8, 4, 128, 4096),
        (8, 8, 4, 4096, 128),
        (1, 2, 2, 20, 32),
        (4, 2, 2, 20, 32),
    ]:
        print(f"matmul B={B} H={H} M={M} K={D} N={N}:", matmul_rounding(B, H, M, D, N, rng))
    for B, n_kv, group, dim, bits, T in [
        (4, 2, 2, 32, 4, 20),
        (1, 2, 2, 32, 4, 20),
        (8, 8, 4, 128, 4, 4096),
        (2, 1, 2, 32, 4, 9),
    ]:
        print(
            f"kernel - vectorized B={B} kv={n_kv} g={group} D={dim} bits={bits} T={T}:",
            kernel_vs_vectorized(B, n_kv, group, dim, bits, T, 7),
            flush=True,
        )


if __name__ == "__main__":
    main()
