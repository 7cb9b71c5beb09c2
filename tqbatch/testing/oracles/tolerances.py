"""How far two float computations of one quantity may drift apart, and why.

The harness compares a cache with a per-request ``TurboQuantKVCache`` that
holds the same packed codes. The two compute the same mathematical values by
different routes: batched against single-request shapes (another accumulation
order), masked against unmasked kernels, mlx-vlm's rotated-query decode path
against dequantize + SDPA. Rounding is the only legitimate difference, so the
tolerances here are bounds on rounding, derived for the matmul precision in
effect and computed from each case's own operands. They are not measurements
of one machine: a GPU that sums in another order passes where the CPU does.

Derivation (Higham, *Accuracy and Stability of Numerical Algorithms*, 2002,
§3.1; Higham & Mary, "A New Approach to Probabilistic Rounding Error
Analysis", SIAM J. Sci. Comput. 41(5), 2019):

* An inner product of ``n`` terms computed in floating point with unit
  roundoff ``u`` differs from the exact one by at most ``γ_n Σ|x_i y_i|``
  (``γ_n = n·u / (1 - n·u)``). Rounding errors behave as independent
  zero-mean variables, so with probability at least ``1 - 2n·exp(-λ²/2)`` the
  bound holds with ``λ√n·u`` in place of ``γ_n`` (Higham & Mary, Thm. 2.4).
  ``λ = LAMBDA = 8`` makes a false alarm rarer than 1e-12 per inner product.
* TF32 (MLX's default for float32 matmuls on CUDA and Apple M5) first rounds
  both operands to a 10-bit mantissa: each product carries an extra relative
  error of at most ``2·u_op`` with ``u_op = 2**-10`` (``2**-11`` for
  round-to-nearest; truncating hardware needs the larger value). At float32
  the operands are used as they are: ``u_op = 0``.
* Two routes that each obey a bound differ by at most twice it.

A real bug moves results by far more than these bounds: a flipped 8-bit code
moves a coordinate by about 2e-2 of the token's norm; a wrong, missing, stale
or padding token (the harness writes padding at 16x scale) moves an attention
output by 1e-2 to 1e1. Each function says what it allows in numbers.
"""

from __future__ import annotations

import math

import numpy as np

from tqbatch.testing.backend import matmul_precision

__all__ = [
    "LAMBDA",
    "UNIT_ROUNDOFF",
    "OPERAND_ROUNDOFF",
    "attention_tolerance",
    "content_tolerance",
    "excess_ratios",
    "fast_exp_error",
    "inner_product_error",
]

# Confidence multiplier of the probabilistic bound (see the module docstring).
LAMBDA = 8.0

# Unit roundoff of float32 accumulation.
UNIT_ROUNDOFF = 2.0**-24

# Relative rounding of each matmul operand before the products, per precision.
OPERAND_ROUNDOFF = {"float32": 0.0, "tf32": 2.0**-10}


def inner_product_error(n: int, precision: str | None = None) -> float:
    """Relative error bound of an ``n``-term inner product, as a multiple of ``Σ|x_i y_i|``.

    ``λ√n·u`` for the float32 accumulation plus ``2·u_op`` for operand
    rounding (TF32); ``precision`` defaults to what the backend computes
    (``tqbatch.testing.backend.matmul_precision``).
    """
    precision = precision or matmul_precision()
    return LAMBDA * math.sqrt(max(n, 1)) * UNIT_ROUNDOFF + 2.0 * OPERAND_ROUNDOFF[precision]


def content_tolerance(want: np.ndarray, precision: str | None = None) -> np.ndarray:
    """Per-token bound on dequantized keys/values from two routes over the same codes.

    ``want``: the reference's dequantized tokens, shape ``(..., T, D)``;
    returns ``(..., T, 1)``. Dequantizing is an inverse rotation ``x = y·R``
    (a dense orthogonal matrix or a Hadamard transform) of the scaled codebook
    vector ``y``: each coordinate is a ``D``-term inner product, and with unit
    columns ``Σ_j |y_j R_jk| <= ||y||₂ = ||x||₂`` (Cauchy-Schwarz; the rotation
    keeps norms). The norm scaling adds one more rounding, folded in as one
    extra term (``D + 1``). Both routes may err, hence the factor 2.

    In numbers, for a unit-normal token at D = 128 (norm ~11): 1.2e-4 at
    float32 (measured on the CPU: 0.0, both routes sum in the same order),
    4.3e-2 at TF32. A wrong, stale or shifted token moves coordinates by
    ~norm/sqrt(D) ~ 1, a flipped 4-bit code by ~1e-1.
    """
    want = np.asarray(want, dtype=np.float64)
    d = want.shape[-1]
    norms = np.sqrt(np.sum(want * want, axis=-1, keepdims=True))
    return 2.0 * inner_product_error(d + 1, precision) * norms


def attention_tolerance(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray,
    scale: float,
    precision: str | None = None,
) -> np.ndarray:
    """Bound on attention outputs of two routes over the same dequantized keys and values.

    One request: ``queries (Hq, N, D)``, reference ``keys``/``values``
    ``(Hkv, T, D)`` (``Hq`` a multiple of ``Hkv``), ``mask (N, T)`` bool,
    True where a query attends. Returns an array broadcastable to the
    ``(Hq, N, D)`` output.

    Scores ``s_j = scale·q·k_j`` may be computed from rotated operands (the
    decode path rotates the query; dequantizing rotates the keys), so the
    basis-independent ``|q|·|k_j|`` bounds ``Σ|q_i k_ji|``, and up to three
    chained products (query rotation, key rotation, the dot product) each add
    ``inner_product_error(D)``: ``|Δs_j| <= 2·3·e_D·scale·|q|·|k_j|``.
    Softmax turns score errors into output errors of at most
    ``2·max_j|Δs_j| · Σ_j p_j |v_j - o|`` (first order: ``Δo = Σ_j p_j (Δs_j -
    Σ_l p_l Δs_l) v_j``), and the value side adds ``2·(e_T + e_D)·Σ_j p_j
    ||v_j||₂``: the weighted sum, and the rotation back from the codec's
    basis, whose per-coordinate error is bounded by the vector's 2-norm (as
    in :func:`content_tolerance`).

    Metal compiles kernels with fast math, whose single-precision ``exp(x)``
    is specified to ``3 + floor(|2x|)`` ulp (Metal Shading Language
    Specification, "Accuracy of single-precision floating-point functions in
    fast math mode"; the bound OpenCL gives ``exp`` under relaxed math), not
    the CPU's ~1 ulp. mlx-vlm's decode kernels compute softmax weights with
    it, at ``x_j = s_j - max_l s_l <= 0``: weight ``p_j`` is off by at most
    ``ε_j = (3 + 2|x_j|)·2**-23`` relative (one ulp of a float32 is at most
    ``2**-23`` of it), and after normalising the output moves by at most
    ``Σ_j p_j·ε_j·|v_j - o|`` (first order, as for score errors). Either
    route may be Metal's, hence 2x; the term is always included, so a verdict
    does not depend on the machine (it is ~1e-6 of the spread elsewhere).

    In numbers (unit-normal operands, D = 64, T = 30): ~3e-4 at float32,
    ~1e-1 at TF32. At TF32 this check resolves gross errors only (attending
    a 16x padding slot moves outputs by >1); the content check above still
    pins every token.
    """
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    hq, _, d = q.shape
    hkv, t, _ = k.shape
    group = hq // hkv
    k = np.repeat(k, group, axis=0)  # (Hq, T, D)
    v = np.repeat(v, group, axis=0)
    allowed = np.asarray(mask, dtype=bool)[None]  # (1, N, T)

    scores = scale * np.einsum("hnd,htd->hnt", q, k)
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.where(allowed, np.exp(scores - top), 0.0)
    weights /= np.maximum(weights.sum(axis=-1, keepdims=True), np.finfo(np.float64).tiny)
    out = np.einsum("hnt,htd->hnd", weights, v)

    e_d = inner_product_error(d, precision)
    e_t = inner_product_error(t, precision)
    q_norm = np.linalg.norm(q, axis=-1)  # (Hq, N)
    k_norm = np.linalg.norm(k, axis=-1)  # (Hq, T)
    score_err = 2.0 * 3.0 * e_d * scale * q_norm[..., None] * k_norm[:, None, :]
    max_score_err = np.max(np.where(allowed, score_err, 0.0), axis=-1)[..., None]  # (Hq, N, 1)

    deviation = np.abs(v[:, None] - out[:, :, None])  # (Hq, N, T, D)
    spread = np.einsum("hnt,hntd->hnd", weights, deviation)
    magnitude = np.einsum("hnt,ht->hn", weights, np.linalg.norm(v, axis=-1))[..., None]
    exp_err = np.where(allowed, fast_exp_error(scores - top), 0.0)  # (Hq, N, T)
    exp_spread = np.einsum("hnt,hntd->hnd", weights * exp_err, deviation)
    return 2.0 * max_score_err * spread + 2.0 * (e_t + e_d) * magnitude + 2.0 * exp_spread


def fast_exp_error(x: np.ndarray) -> np.ndarray:
    """Relative error bound of Metal's fast-math float32 ``exp(x)``: ``(3 + floor(|2x|))`` ulp.

    An ulp of a float32 is at most ``2**-23`` of its value. Masked arguments
    (``-inf``) get 0: their weight is exactly 0 on every route.
    """
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    ulps = 3.0 + np.floor(np.abs(2.0 * np.where(finite, x, 0.0)))
    return np.where(finite, ulps * 2.0**-23, 0.0)


def excess_ratios(got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """``|got - want| / tol`` elementwise: a comparison passes where this is <= 1.

    0 where the two are equal (even with a tolerance of 0); inf where a
    tolerance of 0 is exceeded or ``got`` is NaN, so NaN never passes.
    """
    diff = np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64))
    tol = np.broadcast_to(np.asarray(tol, dtype=np.float64), diff.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(diff == 0, 0.0, diff / tol)
    return np.where(np.isnan(ratio), np.inf, ratio)


# ---- tolerances of recorded quantities (golden scenarios' tolerance tables)

EXACT = {"atol": 0, "rtol": 0, "max_mismatch_fraction": 0}

CROSS_PLATFORM_NOTE = (
    "Not measured (no Metal machine here): Metal's fused quantize kernel and GPU matmuls "
    "round differently from the CPU, so a coordinate within float32 rounding of a codebook "
    "boundary can land in the neighbouring bucket."
)

# Packed codes and norms replayed on another platform than the recording's.
PACKED_CROSS_PLATFORM = {
    "atol": 0,
    "rtol": 0.001,
    "max_mismatch_fraction": 0.02,
    "reason": CROSS_PLATFORM_NOTE + " Float16 norms may differ in their last bit "
    "(rtol 1e-3 ~ one float16 ulp); up to 2% of packed words may hold a flipped "
    "bucket. A geometry bug moves whole tokens: ~100% of a row's words.",
}
