"""How long a malformed ``meta_state`` takes to be rejected (goal: < 100 ms).

Every field is checked before a codec is built (``tqbatch._validate``); before
that, head_dim 4096 took ~24 s to be rejected and bits 16 ~105 s, and
head_dim 1e5 ended in MemoryError. Measured with pytest-benchmark, read from
the report, never asserted on time; what is asserted is the typed error.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import tqbatch

CASES = {  # field index -> malformed value
    "head_dim 4096": (5, "4096"),
    "head_dim 100000": (5, "100000"),
    "bits 16": (1, "16.0"),
    "bits inf": (1, "inf"),
    "seed 10**23": (2, str(10**23)),
}


@pytest.fixture(scope="module")
def cache():
    c = tqbatch.BatchTurboQuantKVCache([0, 1], bits=4.0)
    kv = mx.ones((2, 2, 3, 64))
    c.update_and_fetch(kv, kv)
    return c


@pytest.mark.parametrize("case", list(CASES))
def test_meta_state_rejection(benchmark, cache, case):
    index, value = CASES[case]
    meta = list(cache.meta_state)
    meta[index] = value
    if index == 5:
        meta[6] = value

    def reject():
        try:
            cache.meta_state = tuple(meta)
        except ValueError:
            return True
        return False

    benchmark.group = "meta_state rejection (goal < 100 ms)"
    assert benchmark.pedantic(reject, rounds=20, iterations=1)
