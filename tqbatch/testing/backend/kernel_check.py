"""mlx-vlm's Metal kernels against plain MLX ops: the custom-kernel part of the backend check.

On a Mac's GPU, tqbatch's cache does not run its own codec (``tqbatch._codec.covers``
is False there): every write, read-out and decode step goes through mlx-vlm's
codec and attention methods, and those dispatch mlx-vlm's fused kernels
(``mx.fast.metal_kernel``). A device can run MLX's own ops right and custom
kernels wrong (on GitHub's hosted macOS runners, a paravirtual Metal device,
custom kernels have been reported to return zeros), so where the cache would
run these kernels the backend check (``tqbatch.testing.backend``) takes each
of those steps twice, at tiny shapes: through mlx-vlm's entry points
(``METAL``) and through tqbatch's codec in plain MLX ops (``PLAIN``).
:func:`problems` names every disagreement, error and all-zeros result;
:func:`run` gives each case's result and time, for the backend report.

The reference is tqbatch's codec, not mlx-vlm's fallbacks, because on Metal
those fallbacks pack and unpack codes with custom kernels too
(``_pack_lowbit_kernel``, ``_unpack_lowbit_kernel``). tqbatch's codec is
matmuls, gathers, shifts, sums and a Hadamard transform (the ops the
known-answer check has just verified), and off Metal it writes the very bits
mlx-vlm's codec writes (``tests/unit/test_codec.py``).

Both paths are arguments, so the comparison is tested where no Metal kernel
runs: off Metal ``METAL`` runs mlx-vlm's plain fallbacks, and the tests pass
paths that return zeros, fail a build once or are slightly wrong
(``tests/unit/test_backend_kernels.py``); on a simulated Mac ``METAL``
launches emulated kernels (``tests/unit/test_simulated_metal.py``).

Imports mlx and mlx-vlm; ``tqbatch.testing.backend`` imports this module only
where the cache runs Metal kernels (a Mac's GPU lane).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_vlm.turboquant import TurboQuantKVCache, TurboQuantMSEState, _TurboQuantMSECodec

from tqbatch import _codec

__all__ = [
    "CASES",
    "METAL",
    "PLAIN",
    "Case",
    "CaseResult",
    "CodecPath",
    "far_from_midpoints",
    "problems",
    "run",
]

BITS = 4
SEED = 0

# float32's unit roundoff.
F32 = 2.0**-24
# A TF32 matmul rounds each operand to 10 explicit mantissa bits, to nearest.
TF32_OPERAND = 2.0**-11
# Metal's fast-math exp (mlx-vlm's decode kernels call fast::exp) is specified
# to a few ulp plus an error growing with |x|; 2**-16 relative (512 ulp)
# covers softmax arguments up to a few hundred, far beyond the scores here.
EXP = 2.0**-16
# Each write check's token, normalised and rotated (what the codes are chosen
# from), lies at least this far from every codebook midpoint, so every correct
# quantizer chooses the same codes and they must match exactly. The token is
# built by the codec's inverse rotation and quantized through its forward one:
# per coordinate that round trip moves it by at most 2 * (2 * TF32_OPERAND + D
# * F32), 2.0e-3 at TF32 and D = 96 for a dense rotation (1.1e-5 at float32),
# and normalising by a few F32 more. 4e-3 is twice that; the cells' half-widths
# at 4 bits and D <= 96 are 0.0128 or more, and codebook vectors scaled to unit
# norm (what ``far_from_midpoints`` builds) keep that margin at every draw tried.
MARGIN = 4e-3


@dataclass(frozen=True)
class CodecPath:
    """One implementation of the codec steps the cache takes on a device.

    ``write(key_codec, value_codec, keys, values)`` returns the two packed
    states of (B, H, T, D) tokens; ``dequantize(codec, state)`` the (B, H, T,
    D) float32 tokens; ``decode(queries, key_state, value_state, key_codec,
    value_codec, scale, mask)`` the attention of (B, Hq, 1, D) queries.
    """

    name: str
    write: Callable
    dequantize: Callable
    decode: Callable


def _mlx_vlm_holder(key_codec, value_codec) -> TurboQuantKVCache:
    cache = TurboQuantKVCache(bits=key_codec.bits, seed=SEED)
    cache.key_codec, cache.value_codec = key_codec, value_codec
    return cache


def _mlx_vlm_write(key_codec, value_codec, keys, values):
    # As BatchTurboQuantKVCache.update_and_fetch on Metal: mlx-vlm's fused
    # key+value kernel where it applies (one token, dense rotation), else each
    # codec's quantize (tqbatch._codec.quantize defers to it on Metal).
    new_keys, new_values = _mlx_vlm_holder(key_codec, value_codec)._try_fused_kv_quantize(
        keys, values
    )
    if new_keys is None:
        new_keys, new_values = key_codec.quantize(keys), value_codec.quantize(values)
    return new_keys, new_values


def _mlx_vlm_dequantize(codec, state):
    return codec.dequantize(state)


def _mlx_vlm_decode(queries, keys, values, key_codec, value_codec, scale, mask):
    # The batch cache's decode_attention calls this (super()) on Metal, with
    # mask None (no padding) or the boolean array of its own causal mask.
    return _mlx_vlm_holder(key_codec, value_codec).decode_attention(
        queries, keys, values, scale=scale, mask=mask
    )


def _plain_write(key_codec, value_codec, keys, values):
    return _codec.quantize_plain(key_codec, keys), _codec.quantize_plain(value_codec, values)


def _plain_decode(queries, keys, values, key_codec, value_codec, scale, mask):
    return _codec.attend_plain(queries, keys, values, key_codec, value_codec, scale, mask)


METAL = CodecPath("mlx-vlm", _mlx_vlm_write, _mlx_vlm_dequantize, _mlx_vlm_decode)
PLAIN = CodecPath("plain MLX ops", _plain_write, _codec.dequantize_plain, _plain_decode)


@dataclass(frozen=True)
class Case:
    """One step the cache takes on Metal, at a shape that selects particular kernels."""

    step: str  # "write", "dequantize" or "decode"
    kernels: str  # what mlx-vlm 0.7.10 dispatches for it on Metal
    via: str  # the mlx-vlm entry point the cache reaches
    dim: int
    tokens: int
    kv_heads: int = 1
    q_heads: int = 2
    masked: bool = False

    def __str__(self) -> str:
        shape = f"{self.tokens} token(s), {self.kv_heads} KV head(s), D={self.dim}, {BITS} bits"
        if self.step == "decode":
            mask = "a boolean mask" if self.masked else "no mask"
            shape += f", {self.q_heads} query head(s), {mask}"
        return f"mlx-vlm's {self.kernels} ({self.via}; {shape})"


# The steps the batch cache takes on Metal (mlx-vlm 0.7.10 picks the kernels by
# shape): writes of several tokens and of one token at a dense rotation; the
# read-out (dequantize, also under prefill's attention); decode without a mask
# (no padding) and with the cache's boolean mask, which takes mlx-vlm's
# chunked path; decode beyond 2048 tokens; decode at a head_dim that is not a
# multiple of 32. The harness's head_dims (32-256, 80 and 96 among them) reach
# all of these.
CASES: tuple[Case, ...] = (
    Case("write", "_fused_norot_quantize_kernel", "_TurboQuantMSECodec.quantize", 64, 3, 2),
    Case(
        "write",
        "_fused_kv_quantize_kernel",
        "_try_fused_kv_quantize, one token at a dense rotation",
        96,
        1,
        2,
    ),
    Case("dequantize", "_unpack_lowbit_kernel", "_TurboQuantMSECodec.dequantize", 64, 3, 2),
    Case("decode", "_fused_mse_decode_kernel", "decode_attention", 64, 5),
    Case(
        "decode",
        "_fused_mse_decode_2pass_1_kernel and _fused_mse_decode_2pass_2_kernel",
        "decode_attention over more than 2048 tokens",
        64,
        2050,
    ),
    Case(
        "decode",
        "_mse_score_tiled_kernel and _mse_scores_weighted_rot_sum_repeat_kernel",
        "decode_attention's chunked path",
        64,
        5,
        masked=True,
    ),
    Case(
        "decode",
        "_mse_score_tiled_kernel and _mse_weighted_rot_kernel",
        "decode_attention's chunked path",
        64,
        5,
        q_heads=1,
        masked=True,
    ),
    Case(
        "decode",
        "_mse_score_tiled_kernel and _single_tile_value_weighted_sum_kernel",
        "decode_attention's separate score and value kernels",
        80,
        5,
    ),
)


def far_from_midpoints(codec, shape: tuple[int, ...], rng: np.random.Generator):
    """(*shape, D) float32 tokens, and the codes any correct quantizer gives them.

    Each token's normalised, rotated coordinates are codebook values scaled to
    a unit vector, kept only where every coordinate lies ``MARGIN`` or more
    from every midpoint: no rounding can tip a code, so codes compare exactly.
    """
    mids = np.array(codec._midpoints, dtype=np.float64)
    book = np.array(codec.codebook, dtype=np.float64)
    count = int(np.prod(shape))
    rotated, codes = [], []
    while len(rotated) < count:
        draw = rng.standard_normal(codec.dim)
        # searchsorted counts the midpoints strictly below: mlx-vlm's code.
        code = np.searchsorted(mids, draw / np.linalg.norm(draw))
        y = book[code] / np.linalg.norm(book[code])
        if np.array_equal(np.searchsorted(mids, y), code) and (
            np.abs(y[:, None] - mids).min() >= MARGIN
        ):
            rotated.append(y)
            codes.append(code)
    y = mx.array(np.stack(rotated).reshape(*shape, codec.dim).astype(np.float32))
    norms = mx.array(rng.uniform(0.5, 4.0, (*shape, 1)).astype(np.float32))
    return codec._rotate_inverse(y) * norms, np.stack(codes).reshape(*shape, codec.dim)


def _tokens(rng: np.random.Generator, shape: tuple[int, ...]) -> mx.array:
    """Random directions at norms 0.5-2."""
    x = rng.standard_normal(shape)
    x *= rng.uniform(0.5, 2.0, (*shape[:-1], 1)) / np.linalg.norm(x, axis=-1, keepdims=True)
    return mx.array(x.astype(np.float32))


def _evaluated(fn, *args):
    out = fn(*args)
    # A kernel that fails to build or launch fails here, inside the step.
    mx.eval(out)
    return out


def _numpy(a) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a)


def _zeros(*arrays) -> bool:
    return not any(np.any(_numpy(a)) for a in arrays)


def _state_problems(side: str, got, want, dim: int) -> list[str]:
    """Where a kernel's packed state differs from plain MLX ops': codes exactly, norms to 1 ulp."""
    if not isinstance(got, TurboQuantMSEState):
        return [f"{side}: returned a {type(got).__name__}, not a packed MSE state"]
    if got.indices.shape != want.indices.shape or got.norms.shape != want.norms.shape:
        return [
            f"{side}: returned codes {tuple(got.indices.shape)} and norms "
            f"{tuple(got.norms.shape)}, plain MLX ops {tuple(want.indices.shape)} and "
            f"{tuple(want.norms.shape)}"
        ]
    if _zeros(got.indices, got.norms) and not _zeros(want.indices, want.norms):
        return [f"{side}: returned all zeros (plain MLX ops did not)"]
    found = []
    g_codes = _numpy(_codec.unpack(got.indices, BITS, dim))
    w_codes = _numpy(_codec.unpack(want.indices, BITS, dim))
    wrong = np.argwhere(g_codes != w_codes)
    if len(wrong):
        first = tuple(int(i) for i in wrong[0])
        found.append(
            f"{side}: {len(wrong)} of {w_codes.size} codes differ from plain MLX ops' "
            f"(first at batch, head, token, coordinate {first}: {g_codes[first]}, plain "
            f"{w_codes[first]}); the inputs "
            f"lie {MARGIN} or more from every midpoint, so no rounding explains it"
        )
    # Both paths compute the float32 norm to within D * F32 and round it to
    # float16; two such roundings land on the same or adjacent float16 values,
    # one float16 ulp (<= 2**-10 of the norm) apart at most.
    g_norms, w_norms = _numpy(got.norms), _numpy(want.norms)
    off = ~(np.abs(g_norms - w_norms) <= 2.0**-10 * np.abs(w_norms))
    if off.any():
        worst = np.unravel_index(np.argmax(np.where(off, np.abs(g_norms - w_norms), -1)), off.shape)
        found.append(
            f"{side}: {int(off.sum())} of {off.size} norms differ from plain MLX ops' by more "
            f"than one float16 ulp (worst {g_norms[worst]:.6g}, plain {w_norms[worst]:.6g})"
        )
    return found


def _output_problems(got, want, tol: float) -> list[str]:
    """Where a kernel's float output is off plain MLX ops' by more than ``tol``."""
    if not isinstance(got, mx.array):
        return [f"returned a {type(got).__name__}, not an array"]
    if got.shape != want.shape:
        return [f"returned shape {tuple(got.shape)}, plain MLX ops {tuple(want.shape)}"]
    if _zeros(got) and not _zeros(want):
        return ["returned all zeros (plain MLX ops did not)"]
    g, w = _numpy(got).astype(np.float64), _numpy(want).astype(np.float64)
    if not np.all(np.isfinite(g)):
        return [f"returned {int((~np.isfinite(g)).sum())} non-finite values"]
    err = float(np.abs(g - w).max())
    if err > tol:
        return [f"off plain MLX ops by {err:.3g}, more than the rounding bound {tol:.3g}"]
    return []


def decode_tolerance(
    dim: int, tokens: int, query: float, key: float, value: float, precision: str
) -> float:
    """How far two correct decode paths over the same codes can differ (max over coordinates).

    ``query`` is the scaled query's norm, ``key`` and ``value`` the largest
    dequantized key and value norms; ``precision`` the plain path's matmul
    precision (mlx-vlm's kernels compute in float32 whatever it is). With u =
    F32 and r the matmul operand rounding (0 at float32, TF32_OPERAND at TF32):

    * both rotate the query with the codec's own op (differing by its
      accumulation order at most: D u |q|); a score is a length-D dot product,
      off by D u |q| K in the kernel and (D u + 2r) |q| K in plain ops, so
      the scores differ by ds <= (3 D u + 2r) |q| K;
    * softmax weights then move by at most 2 ds relative, plus each path's exp
      error (EXP) and normalising sum (T u): |dp_t| <= p_t (2 ds + 2 EXP + 2 T u);
    * the weighted sum of T values (norms <= V) adds T u V in each path and 2 r V
      of operand rounding in plain ops: |dw| <= (2 ds + 2 EXP + 4 T u + 2 r) V;
    * the inverse rotation, the same orthogonal op in both, does not grow that
      and adds its own rounding, (2 D u + 2 r) V.

    Twice the sum, for the second-order terms dropped: 1.7e-4 V at float32,
    D = 64, five tokens and |q| K = 2; one 4-bit value code flipped there moves
    the output several times that. At TF32 the bound is some 10 % of the output:
    it resolves zeros and gross errors, not one code.
    """
    r = TF32_OPERAND if precision == "tf32" else 0.0
    ds = (3 * dim * F32 + 2 * r) * query * key
    weighted = 2 * ds + 2 * EXP + 4 * tokens * F32 + 2 * r
    return 2 * (weighted + 2 * dim * F32 + 2 * r) * value


def dequantize_tolerance(dim: int, value: float) -> float:
    """How far two correct read-outs of the same codes can differ (max over coordinates).

    Both look up the same codebook values and apply the codec's own inverse
    rotation and the same norm, so they differ by the rotation's accumulation
    order at most, 2 D u of the token's norm (at TF32 both round the same
    operands alike); twice that.
    """
    return 4 * dim * F32 * value


def _case_problems(case: Case, kernel: CodecPath, plain: CodecPath, precision: str, seed: int):
    rng = np.random.default_rng(seed)
    key_codec = _TurboQuantMSECodec(case.dim, BITS, SEED)
    value_codec = _TurboQuantMSECodec(case.dim, BITS, SEED + 1)
    shape = (1, case.kv_heads, case.tokens)
    if case.step == "write":
        keys, _ = far_from_midpoints(key_codec, shape, rng)
        values, _ = far_from_midpoints(value_codec, shape, rng)
    else:
        # Norms 0.5-2: decode_tolerance grows with the key and value norms, the
        # output with the value norms only, so small norms keep the bound tight.
        keys, values = (_tokens(rng, (*shape, case.dim)) for _ in range(2))
    args = (key_codec, value_codec, keys, values)
    try:
        want = _evaluated(plain.write, *args)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the run stops on it
        return [f"{case}: the plain MLX reference raised {type(exc).__name__}: {exc}"]

    if case.step == "write":
        try:
            got = _evaluated(kernel.write, *args)
        except Exception as exc:  # noqa: BLE001
            return [f"{case}: raised {type(exc).__name__}: {exc}"]
        if not (isinstance(got, tuple) and len(got) == 2):
            return [f"{case}: returned {type(got).__name__}, not (key state, value state)"]
        found = _state_problems("keys", got[0], want[0], case.dim)
        found += _state_problems("values", got[1], want[1], case.dim)
        return [f"{case}: {p}" for p in found]

    # Reads take the plain path's states: a faulty write kernel is reported once.
    key_state, value_state = want

    def largest_norm(codec, state) -> float:
        tokens = _numpy(plain.dequantize(codec, state)).astype(np.float64)
        return float(np.linalg.norm(tokens, axis=-1).max())

    if case.step == "dequantize":
        step, step_args = kernel.dequantize, (key_codec, key_state)
        tol = dequantize_tolerance(case.dim, largest_norm(key_codec, key_state))
        reference_step = plain.dequantize
    else:
        queries = rng.standard_normal((1, case.q_heads, 1, case.dim)).astype(np.float32)
        scale = case.dim**-0.5
        # The first slot hidden, as left padding is.
        mask = mx.array(np.arange(case.tokens) > 0)[None, None, None] if case.masked else None
        step = kernel.decode
        step_args = (mx.array(queries), key_state, value_state, key_codec, value_codec, scale, mask)
        tol = decode_tolerance(
            case.dim,
            case.tokens,
            float(np.linalg.norm(queries * scale, axis=-1).max()),
            largest_norm(key_codec, key_state),
            largest_norm(value_codec, value_state),
            precision,
        )
        reference_step = plain.decode
    try:
        reference = _evaluated(reference_step, *step_args)
    except Exception as exc:  # noqa: BLE001
        return [f"{case}: the plain MLX reference raised {type(exc).__name__}: {exc}"]
    try:
        got = _evaluated(step, *step_args)
    except Exception as exc:  # noqa: BLE001
        return [f"{case}: raised {type(exc).__name__}: {exc}"]
    return [f"{case}: {p}" for p in _output_problems(got, reference, tol)]


@dataclass(frozen=True)
class CaseResult:
    """One case's outcome: what went wrong (nothing: it passed) and how long it took."""

    case: Case
    problems: tuple[str, ...]
    seconds: float


def run(
    kernel: CodecPath,
    plain: CodecPath,
    cases: Sequence[Case] = CASES,
    precision: str = "float32",
) -> list[CaseResult]:
    """Each case of ``kernel`` against ``plain``, timed, in order.

    ``precision``: the plain path's measured matmul precision (``float32`` or
    ``tf32``), which sets the decode tolerance. Deterministic: each case draws
    its inputs from a generator seeded by its position.
    """
    results = []
    for seed, case in enumerate(cases):
        start = time.perf_counter()
        found = _case_problems(case, kernel, plain, precision, seed)
        results.append(CaseResult(case, tuple(found), time.perf_counter() - start))
    return results


def problems(
    kernel: CodecPath,
    plain: CodecPath,
    cases: Sequence[Case] = CASES,
    precision: str = "float32",
) -> list[str]:
    """Every case where ``kernel`` disagrees with ``plain``, raises or returns zeros (sentences)."""
    return [p for result in run(kernel, plain, cases, precision) for p in result.problems]
