"""tqbatch.persist: a cache written to disk comes back exactly, in another process too."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch import BatchTurboQuantKVCache, load_batch_cache, save_batch_cache


def _single(n: int, d: int, bits: float, seed: int, rng) -> TurboQuantKVCache:
    cache = TurboQuantKVCache(bits=bits, seed=seed)
    if n == 0:
        return cache
    k = mx.array(rng.normal(size=(1, 2, n, d)).astype(np.float32))
    v = mx.array(rng.normal(size=(1, 2, n, d)).astype(np.float32))
    cache.update_and_fetch(k, v)
    return cache


def _packed_bytes(cache: BatchTurboQuantKVCache) -> list[bytes]:
    keys, values, *_ = cache.state
    return [np.array(leaf).tobytes() for s in (keys, values) for leaf in s]


# D=80 at 3 bits is the case the seed's packed-width inference got wrong (85).
@pytest.mark.parametrize("d", [64, 80, 96, 128])
@pytest.mark.parametrize("bits", [3, 3.5, 4])
def test_round_trip_rebuilds_codecs_for_any_head_dim(tmp_path, d, bits):
    rng = np.random.default_rng(d * 10 + int(bits * 2))
    batch = BatchTurboQuantKVCache.merge([_single(n, d, bits, 5, rng) for n in (2, 5, 0)])
    batch.prepare(right_padding=[0, 1, 0])  # pending padding is part of what is saved
    path = tmp_path / "cache.safetensors"
    save_batch_cache(path, batch)

    restored = load_batch_cache(path)

    assert restored.key_codec.dim == d and restored.value_codec.dim == d
    assert restored.offset.tolist() == batch.offset.tolist()
    assert restored.left_padding.tolist() == batch.left_padding.tolist()
    assert restored.size() == batch.size()
    assert restored.meta_state == batch.meta_state
    assert _packed_bytes(restored) == _packed_bytes(batch)
    # Same packed bits and a codec rebuilt from the same (head_dim, bits, seed):
    # dequantization is the same computation, so equality is exact.
    for got, want in zip(restored.dequantize(), batch.dequantize()):
        assert mx.array_equal(got, want)


def test_restore_in_a_fresh_process_is_bit_exact(tmp_path):
    rng = np.random.default_rng(0)
    batch = BatchTurboQuantKVCache.merge([_single(n, 80, 3.5, 1, rng) for n in (4, 1)])
    path = tmp_path / "cache.safetensors"
    save_batch_cache(path, batch)
    keys, values = batch.dequantize()
    np.save(tmp_path / "want.npy", np.concatenate([np.array(keys), np.array(values)]))

    script = (
        "import sys, numpy as np\n"
        "from tqbatch import load_batch_cache\n"
        "k, v = load_batch_cache(sys.argv[1]).dequantize()\n"
        "got = np.concatenate([np.array(k), np.array(v)])\n"
        "assert (got == np.load(sys.argv[2])).all(), 'restored cache differs'\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(path), str(tmp_path / "want.npy")], check=True
    )


def test_empty_cache_round_trips(tmp_path):
    path = tmp_path / "empty.safetensors"
    save_batch_cache(path, BatchTurboQuantKVCache([0, 3], bits=4))
    restored = load_batch_cache(path)
    assert restored.empty()
    assert restored.left_padding.tolist() == [0, 3]
    assert restored.offset.tolist() == [0, -3]


def test_foreign_file_is_rejected(tmp_path):
    path = tmp_path / "other.safetensors"
    mx.save_safetensors(str(path), {"x": mx.zeros((1,))})
    with pytest.raises(ValueError, match="not written by tqbatch"):
        load_batch_cache(path)
