"""The harness's codebook solve against mlx-vlm's, bit for bit, and where it stands in."""

from __future__ import annotations

import itertools
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm import turboquant
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.testing.backend import codebooks

# mlx-vlm's solve, held before any test could leave a replacement behind.
MLX_VLM_CODEBOOK = turboquant._codebook
# Another mlx-vlm's solve (another source) is left in place, and solve() is
# not held to it: the tests that compare the two skip.
MATCHES = codebooks.matches_mlx_vlm()
same_solve = pytest.mark.skipif(
    not MATCHES, reason="this mlx-vlm's _codebook is not the one solve() reproduces"
)

# What tqbatch.testing.contract.strategies.configs draws: widths, per-side
# widths, head dims; a fractional width splits the channels between two widths.
WIDTHS = (2.0, 2.5, 3.0, 3.5, 4.0, 6.0, 8.0)
SIDE_WIDTHS = (2, 3, 4, 6, 8)
HEAD_DIMS = (32, 64, 80, 96, 128, 256)


def _asked_for() -> set[tuple[int, int]]:
    """Every (dim, bits) the codecs of the harness's configurations ask mlx-vlm to solve."""
    asked = set()

    def recording(dim, bits):
        asked.add((dim, bits))
        return MLX_VLM_CODEBOOK(dim, bits)

    configs = [{"bits": w} for w in WIDTHS] + [
        {"bits": 4.0, "key_bits": k, "value_bits": v}
        for k, v in itertools.product(SIDE_WIDTHS, SIDE_WIDTHS)
    ]
    with mock.patch.object(turboquant, "_codebook", recording):
        for config, dim in itertools.product(configs, HEAD_DIMS):
            tokens = mx.random.normal((1, 1, 2, dim), key=mx.random.key(dim))
            TurboQuantKVCache(**config)._ensure_codecs(tokens, tokens)
    return asked


# Every width at every head dim; the first test shows these are the pairs asked for.
ASKED = sorted(itertools.product(HEAD_DIMS, SIDE_WIDTHS))


def test_the_configurations_ask_for_every_width_at_every_head_dim():
    """The pairs below are what the harness draws (a fractional width's two halves each
    solve at the whole head dim)."""
    assert sorted(_asked_for()) == ASKED


@same_solve
@pytest.mark.parametrize(("dim", "bits"), ASKED + [(1, 3), (2, 4), (3, 8), (80, 0), (80, 1)])
def test_solve_equals_mlx_vlm(dim, bits):
    want = np.array(MLX_VLM_CODEBOOK(dim, bits))
    got = np.array(codebooks.solve.__wrapped__(dim, bits))  # solved afresh, not cached
    assert got.dtype == want.dtype == np.float32
    assert got.shape == want.shape and got.tobytes() == want.tobytes()


@same_solve
def test_a_solve_summing_otherwise_differs():
    """Bit for bit is not a given: the same buckets summed in float64 end elsewhere."""

    def float64_mean(grid, weights, run):
        w = weights[run].astype(np.float64)
        return np.float32(np.sum(w * grid[run]) / w.sum())

    with mock.patch.object(codebooks, "_weighted_mean", float64_mean):
        got = np.array(codebooks.solve.__wrapped__(128, 4))
    assert got.tobytes() != np.array(MLX_VLM_CODEBOOK(128, 4)).tobytes()


@same_solve
def test_codecs_built_inside_get_the_fast_solve():
    with codebooks.fast_codebooks():
        assert turboquant._codebook is codebooks.solve
        cache = TurboQuantKVCache(bits=3.0)
        tokens = mx.ones((1, 1, 1, 64))
        cache._ensure_codecs(tokens, tokens)
    assert turboquant._codebook is MLX_VLM_CODEBOOK
    want = np.array(MLX_VLM_CODEBOOK(64, 3))
    assert np.array(cache.key_codec.codebook).tobytes() == want.tobytes()


def test_another_mlx_vlm_solve_is_left_in_place():
    """A ``_codebook`` with other source (another mlx-vlm) is not replaced."""

    def changed(dim, bits):
        return MLX_VLM_CODEBOOK(dim, bits) * 1.0

    codebooks.matches_mlx_vlm.cache_clear()
    try:
        with mock.patch.object(turboquant, "_codebook", changed):
            assert not codebooks.matches_mlx_vlm()
            with codebooks.fast_codebooks():
                assert turboquant._codebook is changed
    finally:
        codebooks.matches_mlx_vlm.cache_clear()
    assert codebooks.matches_mlx_vlm() is MATCHES  # the installed one, read again
