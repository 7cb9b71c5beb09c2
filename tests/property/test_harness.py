"""Meta-tests of the harness helpers: the model, the oracles and the executor.

Like array-api-tests' own tests of its helpers: a harness that agrees with
itself but not with mlx-lm, or that cannot see a wrong target, is worthless.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.base import create_causal_mask
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.turboquant import TurboQuantKVCache

import tqbatch
from tqbatch.testing.oracles.numpy_model import attention, causal_mask
from tqbatch.testing.target import ImplSpecError, capabilities, load_impl
from tqbatch.testing.world import World


@given(
    n=st.integers(1, 5),
    end=st.integers(0, 12),
    left_padding=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    window=st.none() | st.integers(1, 8),
)
def test_model_mask_matches_mlx_lm(n, end, left_padding, window):
    want = np.array(
        create_causal_mask(n, offset=end, left_padding=mx.array(left_padding), window_size=window)
    )
    got = causal_mask(n, end, left_padding, window)
    assert got.shape == want.shape
    assert np.array_equal(got, want)


def test_load_impl_sources(monkeypatch):
    monkeypatch.delenv("TQBATCH_IMPL", raising=False)
    assert load_impl() is tqbatch.BatchTurboQuantKVCache
    monkeypatch.setenv("TQBATCH_IMPL", "mlx_vlm.turboquant:BatchTurboQuantKVCache")
    from mlx_vlm.turboquant import BatchTurboQuantKVCache as Upstream

    assert load_impl() is Upstream
    assert load_impl("tqbatch:BatchTurboQuantKVCache") is tqbatch.BatchTurboQuantKVCache
    # The short names of ALIASES, from an argument or from the environment.
    assert load_impl("tqbatch") is tqbatch.BatchTurboQuantKVCache
    assert load_impl("mlx-vlm") is Upstream
    monkeypatch.setenv("TQBATCH_IMPL", "tqbatch")
    assert load_impl() is tqbatch.BatchTurboQuantKVCache
    bad_specs = ("tqbatch.cache", "no_such_module:X", "tqbatch:Nope", "tqbatch:__version__")
    for bad in (*bad_specs, "math:sqrt", "mlx_vlm"):
        with pytest.raises(ImplSpecError, match="implementation"):
            load_impl(bad)


def test_capabilities_of_upstream():
    from mlx_vlm.turboquant import BatchTurboQuantKVCache as Upstream

    caps = capabilities(Upstream)
    assert not caps["merge"] and not caps["prepare"] and not caps["finalize"]
    assert caps["filter"] and caps["extend"] and caps["extract"] and caps["trim"]
    assert all(capabilities(tqbatch.BatchTurboQuantKVCache).values())


SCENARIO = [
    {"op": "merge", "lengths": [3, 0, 5], "kv_seed": 1},
    {"op": "attend", "queries": 1, "q_heads": 4, "q_seed": 2},
    {"op": "extend", "other": [{"op": "new", "left_padding": [2]}]},
    {"op": "attend", "queries": 3, "q_heads": 2, "q_seed": 3},
    {"op": "filter", "indices": [3, 0]},
    {"op": "attend", "queries": 2, "q_heads": 4, "q_seed": 4, "window_size": 2},
]


def run(impl, ops=SCENARIO, check=True):
    world = World(impl, bits=3.0, seed=1)
    for op in ops:
        world.apply(op)
        if check:
            world.check()
    return world


def test_executor_accepts_the_reference_implementation():
    world = run(tqbatch.BatchTurboQuantKVCache)
    assert world.numpy_model.batch_size == 2


class LeakyMask(tqbatch.BatchTurboQuantKVCache):
    """Masks ignore left padding: rows attend to padding slots."""

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        return create_causal_mask(N, offset=self.size(), window_size=window_size)


class NoisyRows(tqbatch.BatchTurboQuantKVCache):
    """Dequantized keys off by 1e-3: ~10x the float32 rounding bound at these norms."""

    def dequantize(self, keys_state=None, values_state=None):
        k, v = super().dequantize(keys_state, values_state)
        return k + 1e-3, v


class FlipsOneCode(tqbatch.BatchTurboQuantKVCache):
    """Every write puts one coordinate of row 0's newest key in the neighbouring codebook cell.

    The smallest content bug there is: the lowest bit of the first packed
    word is the first coordinate's code, and codes 2i and 2i+1 are adjacent
    centroids.
    """

    def _quantize(self, keys, values):
        new_keys = self.key_codec.quantize(keys)
        flip = np.zeros(new_keys.indices.shape, dtype=np.uint32)
        flip[0, 0, -1, 0] = 1
        flipped = new_keys._replace(indices=new_keys.indices ^ mx.array(flip))
        return flipped, self.value_codec.quantize(values)


class FilterMutatesThenRaises(tqbatch.BatchTurboQuantKVCache):
    """Bad input changes the geometry before the error is raised."""

    def filter(self, batch_indices):
        self.offset = self.offset + 1
        super().filter(batch_indices)


def test_executor_detects_wrong_mask():
    with pytest.raises(AssertionError, match="make_mask"):
        run(LeakyMask)


def test_attention_check_sees_poisoned_padding_without_mask_check():
    # No check() at all: the attend op alone must notice attention to padding.
    with pytest.raises(AssertionError, match="attention of row"):
        run(LeakyMask, check=False)


@pytest.mark.float32_only(
    reason="a 1e-3 drift is ~10x the float32 content bound here but below TF32's (~4e-2)"
)
def test_executor_detects_dequantization_drift():
    with pytest.raises(AssertionError, match="dequantized keys differ"):
        run(NoisyRows)


_ONE_CODE_AT_TF32 = pytest.mark.float32_only(
    reason="at TF32 the content bound (~4e-2 at norm 11) exceeds one 4- or 8-bit code's "
    "move spread over D=128 coordinates (~2e-2); at 2 bits it does not"
)


@pytest.mark.parametrize(
    "bits",
    [2.0, pytest.param(4.0, marks=_ONE_CODE_AT_TF32), pytest.param(8.0, marks=_ONE_CODE_AT_TF32)],
)
def test_content_check_sees_one_flipped_code(bits):
    """The derived content bound is tighter than the smallest codebook cell, at every width."""
    world = World(FlipsOneCode, bits=bits, seed=1, kv_heads=2, head_dim=128)
    world.apply({"op": "merge", "lengths": [3, 2], "kv_seed": 1})
    world.check()  # merge moves the singles' codes: nothing flipped yet
    world.apply({"op": "update", "tokens": 1, "kv_seed": 2})
    with pytest.raises(
        AssertionError, match=r"row 0 .* dequantized keys differ .* token\(s\) \[3\]"
    ):
        world.check()


def test_expect_error_detects_partial_mutation():
    ops = SCENARIO[:2] + [
        {"op": "expect_error", "inner": {"op": "filter", "indices": [9]}, "error": "IndexError"}
    ]
    with pytest.raises(AssertionError, match="changed the target's offset"):
        run(FilterMutatesThenRaises, ops)


def test_expect_error_detects_acceptance():
    ops = SCENARIO[:1] + [
        {"op": "expect_error", "inner": {"op": "filter", "indices": [0]}, "error": "IndexError"}
    ]
    with pytest.raises(AssertionError, match="accepted the op"):
        run(tqbatch.BatchTurboQuantKVCache, ops)


# Worst RMS error of TurboQuant attention against full precision, measured over
# 150 random cases per width (unit-normal K/V/queries, B=1, H=2, Hq=4, D in
# {32, 64}, 1-48 tokens, 1-4 queries). The harness's verdicts do not rest on it
# (a cache is compared with a per-request TurboQuant reference, which decides
# everything this could); it guards the reference itself: mlx-vlm's codec must
# stay about as accurate as the paper's ~2**-b distortion says.
MEASURED_FP_RMS_ERROR = {2: 0.36, 4: 0.11}


@pytest.mark.parametrize("bits", [2, 4])
def test_turboquant_attention_stays_near_full_precision_on_fresh_draws(bits):
    """Re-sample the measurement (other draws): within twice the worst measured error."""
    rng = np.random.default_rng(2026 + bits)
    worst = 0.0
    for _ in range(40):
        L, D = int(rng.integers(1, 49)), int(rng.choice([32, 64]))
        N = int(rng.integers(1, min(L, 4) + 1))
        k, v = (rng.standard_normal((1, 2, L, D)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((1, 4, N, D)).astype(np.float32)
        cache = TurboQuantKVCache(bits=bits, seed=int(rng.integers(0, 3)))
        ks, vs = cache.update_and_fetch(mx.array(k), mx.array(v))
        m = causal_mask(N, L - N, [0])
        out = np.array(
            scaled_dot_product_attention(
                mx.array(q), ks, vs, cache=cache, scale=D**-0.5, mask=mx.array(m)
            )
        )
        fp = attention(q[0], k[0], v[0], m[0, 0], D**-0.5)
        worst = max(worst, math.sqrt(float(np.mean((out[0] - fp) ** 2))))
    bound = 2.0 * MEASURED_FP_RMS_ERROR[bits]
    assert worst <= bound
    # And the bound is informative: attending to unrelated values is outside it.
    assert bound < 0.8
