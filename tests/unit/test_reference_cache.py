"""The per-request references' dequantization cache equals a fresh dequantize.

``TurboReferences`` keeps each request's dequantized tokens and, on append,
dequantizes only the new ones (quantization is per token); on trim it cuts
the kept array. Either way it must hold what a whole-row dequantize gives.
"""

from __future__ import annotations

import numpy as np
import pytest

from tqbatch.testing.reference import TurboReferences


@pytest.mark.parametrize(("bits", "head_dim"), [(2.0, 64), (3.5, 80), (4.0, 128), (8.0, 64)])
def test_incremental_dequantize_matches_whole_row(bits, head_dim):
    refs = TurboReferences(bits, seed=1)
    refs.new(7)
    rng = np.random.default_rng(0)
    for step, (append, trim) in enumerate([(5, 0), (1, 0), (3, 2), (1, 1), (4, 0)]):
        kv = rng.standard_normal((2, append, head_dim)).astype(np.float32)
        refs.append(7, kv, -kv)
        refs.dequantized(7)  # held, then extended by the next append
        refs.trim(7, trim)
        kept = refs.dequantized(7)
        refs._dequantized.clear()
        fresh = refs.dequantized(7)
        assert kept[0].shape == fresh[0].shape, step
        # Per-token codecs: the same packed codes through the same ops. The
        # inverse rotation of a 1-token block and of the whole row may sum in
        # another order on some BLAS: float32 rounding, far below a code step.
        np.testing.assert_allclose(kept[0], fresh[0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(kept[1], fresh[1], rtol=0, atol=1e-6)
