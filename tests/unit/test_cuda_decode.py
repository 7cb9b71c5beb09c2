"""The fused CUDA decode kernel (``tqbatch._cuda_decode``): where it runs, and that it
computes what the vectorized path computes.

On a CUDA GPU, Hypothesis draws decode steps (rows, heads, group sizes, dims,
bits, left padding, contexts up to 8192, query dtypes) and the kernel must
agree with ``_codec.attend_plain`` within ``_bound``. Everywhere else the
kernel cannot be reached: ``auto`` and ``vectorized`` keep the vectorized
path and ``fused`` refuses. The kernel's source compiles with nvcc for
Hopper where nvcc is installed (no GPU needed).
"""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_vlm.turboquant import _TurboQuantMSECodec

from tqbatch import BatchTurboQuantKVCache, _codec, _cuda_decode
from tqbatch._masks import CausalRows

ON_CUDA = _cuda_decode.available()
gpu_only = pytest.mark.skipif(
    not ON_CUDA, reason="the fused decode kernel runs only where MLX's default device is CUDA"
)


def _states(rng, B, n_kv, T, dim, key_bits, value_bits, spare=3):
    """Packed keys and values of T tokens, as token slices of a larger buffer (as the
    cache hands them over), and their codecs."""
    kc = _TurboQuantMSECodec(dim, key_bits, seed=1)
    vc = _TurboQuantMSECodec(dim, value_bits, seed=2)
    shape = (B, n_kv, T + spare, dim)
    # Tokens of several scales: norms differ, as real keys' do.
    scale = rng.uniform(0.2, 4.0, (B, n_kv, T + spare, 1))
    k = mx.array((rng.standard_normal(shape) * scale).astype(np.float32))
    v = mx.array((rng.standard_normal(shape) * scale).astype(np.float32))
    ks, vs = _codec.quantize_plain(kc, k), _codec.quantize_plain(vc, v)
    cut = lambda s: type(s)(*(a[:, :, :T] for a in s))  # noqa: E731
    return cut(ks), cut(vs), kc, vc


def _bound(want, values, q, keys, key_codec, dtype, T, dim):
    """Elementwise bound on |kernel - vectorized|.

    Both paths compute the same float32 sums in another order: a score
    n_t * <q, c_t> over D terms differs by at most D * eps32 * |q| * |k_t|; the
    softmax weights then differ relatively by at most twice the largest score
    difference; the weighted sum of T value vectors by T * eps32 of
    sum_t w_t |v_t| <= max_t |v_t| (weights sum to 1); the inverse rotation is
    orthogonal, so the rotated-space error bounds every coordinate. Each path
    then rounds its float32 result to the query dtype: one ulp of that dtype
    apart at most.
    """
    eps32 = float(np.finfo(np.float32).eps)
    q_norm = float(np.linalg.norm(q, axis=-1).max())
    k_norm = float(np.abs(np.array(keys.norms.astype(mx.float32))).max())
    v_norm = float(np.abs(np.array(values.norms.astype(mx.float32))).max())
    score = dim * eps32 * q_norm * k_norm
    rotated = (2 * score + (T + dim) * eps32) * v_norm * 2
    ulp = float(mx.finfo(dtype).eps) if dtype != mx.float32 else eps32
    return rotated + ulp * np.abs(want) * 2


@gpu_only
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    B=st.integers(1, 16),
    n_kv=st.integers(1, 8),
    group=st.integers(1, 8),
    dim=st.sampled_from([64, 128]),
    key_bits=st.integers(2, 8),
    value_bits=st.integers(2, 8),
    T=st.one_of(st.integers(1, 300), st.integers(1, 8192)),
    dtype=st.sampled_from([mx.float16, mx.bfloat16, mx.float32]),
    padded=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_kernel_matches_vectorized_path(
    B, n_kv, group, dim, key_bits, value_bits, T, dtype, padded, seed
):
    rng = np.random.default_rng(seed)
    keys, values, kc, vc = _states(rng, B, n_kv, T, dim, key_bits, value_bits)
    queries = mx.array(rng.standard_normal((B, n_kv * group, 1, dim)).astype(np.float32))
    queries = queries.astype(dtype)
    scale = dim**-0.5
    mask = None
    if padded:
        # Left padding below T: each row's own token (T - 1) stays live.
        mask = CausalRows(mx.array(rng.integers(0, T, B).astype(np.int32)), T - 1)
    assert _cuda_decode.supports(queries, keys, values, kc, vc, mask)
    got = _cuda_decode._fused(queries, keys, values, kc, vc, scale, mask)
    want = _codec.attend_plain(queries, keys, values, kc, vc, scale, mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    got = np.array(got.astype(mx.float32))
    want = np.array(want.astype(mx.float32))
    q = np.array((queries * scale).astype(mx.float32))
    bound = _bound(want, values, q, keys, kc, dtype, T, dim)
    excess = np.abs(got - want) - bound
    assert np.all(np.isfinite(got)), "the kernel returned non-finite values"
    assert excess.max() <= 0, (
        f"max |kernel - vectorized| {np.abs(got - want).max():.3g} over the bound "
        f"(worst excess {excess.max():.3g})"
    )


@gpu_only
def test_cache_decode_step_takes_kernel_under_auto(monkeypatch):
    cache = BatchTurboQuantKVCache([2, 0], bits=4)
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((2, 2, 5, 64)).astype(np.float16))
    cache.update_and_fetch(k, k)
    q = mx.array(rng.standard_normal((2, 4, 1, 64)).astype(np.float16))
    step = mx.array(rng.standard_normal((2, 2, 1, 64)).astype(np.float16))
    ks, vs = cache.update_and_fetch(step, step)
    mask = cache.make_mask(1)
    calls = []
    fused = _cuda_decode._fused
    monkeypatch.setattr(_cuda_decode, "_fused", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setenv("TQBATCH_DECODE_KERNEL", "auto")
    got = cache.decode_attention(q, ks, vs, scale=0.125, mask=mask)
    monkeypatch.setenv("TQBATCH_DECODE_KERNEL", "vectorized")
    want = cache.decode_attention(q, ks, vs, scale=0.125, mask=mask)
    assert calls == [1]
    assert np.allclose(np.array(got), np.array(want), atol=2e-3, rtol=2e-3)


# ------------------------------------------------------------------ off CUDA


def _step():
    rng = np.random.default_rng(3)
    keys, values, kc, vc = _states(rng, 2, 2, 9, 64, 4, 4)
    queries = mx.array(rng.standard_normal((2, 4, 1, 64)).astype(np.float16))
    return queries, keys, values, kc, vc


@pytest.mark.skipif(ON_CUDA, reason="checks the kernel is unreachable off CUDA")
def test_off_cuda_the_kernel_is_never_reached(monkeypatch):
    monkeypatch.setattr(_cuda_decode, "_fused", lambda *a: pytest.fail("kernel reached"))
    queries, keys, values, kc, vc = _step()
    assert not _cuda_decode.available()
    for mode in ("auto", "vectorized"):
        monkeypatch.setenv("TQBATCH_DECODE_KERNEL", mode)
        assert _cuda_decode.attend(queries, keys, values, kc, vc, 0.125) is None
    monkeypatch.setenv("TQBATCH_DECODE_KERNEL", "fused")
    with pytest.raises(RuntimeError, match="does not serve this device"):
        _cuda_decode.attend(queries, keys, values, kc, vc, 0.125)


@pytest.mark.skipif(ON_CUDA, reason="checks the kernel is unreachable off CUDA")
def test_off_cuda_the_cache_decodes_on_the_vectorized_path(monkeypatch):
    monkeypatch.setattr(_cuda_decode, "_fused", lambda *a: pytest.fail("kernel reached"))
    cache = BatchTurboQuantKVCache([1, 0], bits=4)
    rng = np.random.default_rng(1)
    k = mx.array(rng.standard_normal((2, 2, 4, 64)).astype(np.float16))
    ks, vs = cache.update_and_fetch(k, k)
    q = mx.array(rng.standard_normal((2, 4, 1, 64)).astype(np.float16))
    outs = []
    for mode in ("auto", "vectorized"):
        monkeypatch.setenv("TQBATCH_DECODE_KERNEL", mode)
        outs.append(np.array(cache.decode_attention(q, ks, vs, scale=0.125, mask=None)))
    assert np.array_equal(outs[0], outs[1])
    monkeypatch.setenv("TQBATCH_DECODE_KERNEL", "fused")
    with pytest.raises(RuntimeError, match="fused"):
        cache.decode_attention(q, ks, vs, scale=0.125, mask=None)


def test_mode_is_read_at_call_time_and_checked(monkeypatch):
    monkeypatch.delenv("TQBATCH_DECODE_KERNEL", raising=False)
    assert _cuda_decode.mode() == "auto"
    monkeypatch.setenv("TQBATCH_DECODE_KERNEL", "Vectorized")
    assert _cuda_decode.mode() == "vectorized"
    monkeypatch.setenv("TQBATCH_DECODE_KERNEL", "fast")
    with pytest.raises(ValueError, match="auto, fused, vectorized"):
        _cuda_decode.mode()


def test_supports_only_what_the_kernel_computes():
    queries, keys, values, kc, vc = _step()
    assert _cuda_decode.supports(queries, keys, values, kc, vc, None)
    rows = CausalRows(mx.array([1, 0], dtype=mx.int32), 8)
    assert _cuda_decode.supports(queries, keys, values, kc, vc, rows)
    two = mx.concatenate([queries, queries], axis=2)
    assert not _cuda_decode.supports(two, keys, values, kc, vc, None)  # not a decode step
    windowed = CausalRows(rows.starts, 8, window=4)
    assert not _cuda_decode.supports(queries, keys, values, kc, vc, windowed)
    array_mask = mx.ones((2, 1, 1, 9), dtype=mx.bool_)
    assert not _cuda_decode.supports(queries, keys, values, kc, vc, array_mask)
    wide = mx.concatenate([queries] * 3, axis=1)  # 6 query heads over 2: fine
    assert _cuda_decode.supports(wide, keys, values, kc, vc, None)
    crowded = mx.concatenate([queries] * 5, axis=1)  # 10 per KV head: over 8
    assert not _cuda_decode.supports(crowded, keys, values, kc, vc, None)


# MLX's JIT prepends its device header (Shape, Strides: fixed arrays passed by
# value) and writes the signature; this stands in for both.
_SHIM = r"""
#include <cuda_fp16.h>
#include <cstdint>
#define MAX_NDIM 10
struct Shape { int32_t v[MAX_NDIM]; __device__ int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[MAX_NDIM]; __device__ int64_t operator[](int i) const { return v[i]; } };
"""


def _signature(name, inputs, outputs, source, consts):
    params = []
    for arg, ctype in inputs:
        params.append(f"const {ctype}* {arg}")
        for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides")):
            if arg + suffix in source:
                params.append(f"const __grid_constant__ {kind} {arg}{suffix}")
    params += [f"{ctype}* {arg}" for arg, ctype in outputs]
    body = "".join(f"  constexpr int {k} = {v};\n" for k, v in consts)
    return f"__global__ void {name}({', '.join(params)}) {{\n{body}{source}\n}}\n"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
def test_kernel_source_compiles_for_hopper(tmp_path):
    inputs = ["q", "kw", "kn", "vw", "vn", "kcb", "vcb", "starts"]
    code = _SHIM + _cuda_decode._HEADER
    for i, (dk, dv, kb, vb, g) in enumerate([(128, 128, 4, 4, 4), (64, 64, 3, 5, 8)]):
        for norm in ("__half", "float"):
            types = ["float", "uint32_t", norm, "uint32_t", norm, "float", "float", "int32_t"]
            consts = [("DK", dk), ("DV", dv), ("KB", kb), ("VB", vb), ("G", g), ("NT", 128)]
            code += _signature(
                f"partial{i}{norm[-1]}",
                list(zip(inputs, types, strict=True)),
                [("pacc", "float"), ("pm", "float"), ("pl", "float")],
                _cuda_decode._PARTIAL,
                consts,
            )
    code += _signature(
        "combine",
        [("pacc", "float"), ("pm", "float"), ("pl", "float")],
        [("out", "float")],
        _cuda_decode._COMBINE,
        [("DV", 128), ("S", 4)],
    )
    src = tmp_path / "decode.cu"
    src.write_text(code)
    result = subprocess.run(
        ["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "d.o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
