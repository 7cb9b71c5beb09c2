"""The per-request references hold what a ``TurboQuantKVCache`` per request holds.

``TurboReferences`` quantizes one op's new tokens of every request in one
codec call and keeps each request's dequantized tokens as numpy arrays,
appended to and cut on trim. Here two requests, appended to together and
trimmed apart, are compared after every step with one mlx-vlm
``TurboQuantKVCache`` per request fed the same tokens one append at a time.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.testing.oracles.reference import TurboReferences, to_numpy

STEPS = [  # (tokens for request 0, tokens for request 1, trim 0, trim 1)
    (5, 3, 0, 0),
    (1, 0, 0, 1),
    (3, 4, 2, 0),
    (1, 1, 1, 1),
    (0, 6, 0, 0),
    (4, 1, 0, 3),
]


@pytest.mark.parametrize(
    ("bits", "head_dim", "key_bits", "value_bits"),
    [
        (2.0, 64, None, None),
        (3.5, 80, None, None),
        (4.0, 128, None, None),
        (8.0, 64, None, None),
        (4.0, 64, 2, 8),
    ],
)
def test_references_equal_a_turboquant_cache_per_request(bits, head_dim, key_bits, value_bits):
    config = dict(bits=bits, seed=1, key_bits=key_bits, value_bits=value_bits)
    refs = TurboReferences(**config)
    alone = {rid: TurboQuantKVCache(**config) for rid in (0, 1)}
    for rid in alone:
        refs.new(rid)
    rng = np.random.default_rng(0)
    for step, (*appends, trim0, trim1) in enumerate(STEPS):
        rows = []
        for rid, n in enumerate(appends):
            kv = rng.standard_normal((2, n, head_dim)).astype(np.float32)
            rows.append((rid, kv, -kv))
            if n:
                alone[rid].update_and_fetch(mx.array(kv[None]), mx.array(-kv[None]))
        refs.append_rows(rows)
        for rid, n in ((0, trim0), (1, trim1)):
            refs.trim(rid, n)
            if n:
                alone[rid].trim(n)
        for rid, cache in alone.items():
            assert refs.length(rid) == cache.offset, (step, rid)
            want_k, want_v = (to_numpy(a[0]) for a in cache.dequantize())
            got_k, got_v = refs.dequantized(rid)
            # Per-token codecs: the same codes through the same ops. A block of
            # one request and of two may sum the rotation in another order on
            # some BLAS: float32 rounding, far below a code step (>= 1e-2).
            np.testing.assert_allclose(got_k, want_k, rtol=0, atol=1e-6, err_msg=f"{step}")
            np.testing.assert_allclose(got_v, want_v, rtol=0, atol=1e-6, err_msg=f"{step}")


def test_an_empty_request_holds_nothing():
    refs = TurboReferences(4.0, seed=0)
    refs.new(3)
    refs.append(3, np.zeros((1, 0, 64), np.float32), np.zeros((1, 0, 64), np.float32))
    assert refs.length(3) == 0 and refs.dequantized(3) == (None, None)
