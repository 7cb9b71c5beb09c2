"""tqbatch.save_batch_cache is atomic: a save that fails part-way loses nothing.

The previous file stays byte-identical and loads to the same cache, no
temporary file is left beside it, and the error reaches the caller.
"""

from __future__ import annotations

import errno
import io
import os
import stat

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch import BatchTurboQuantKVCache, load_batch_cache, persist, save_batch_cache


def _batch(seed: int) -> BatchTurboQuantKVCache:
    rng = np.random.default_rng(seed)
    singles = []
    for n in (4, 2):
        single = TurboQuantKVCache(bits=3.5, seed=1)
        kv = [mx.array(rng.normal(size=(1, 2, n, 64)).astype(np.float32)) for _ in "kv"]
        single.update_and_fetch(*kv)
        singles.append(single)
    return BatchTurboQuantKVCache.merge(singles)


def _state_arrays(cache: BatchTurboQuantKVCache) -> list[np.ndarray]:
    keys, values, offset, left_padding = cache.state
    return [np.array(a) for a in (*keys, *values, offset, left_padding)]


@pytest.fixture
def saved(tmp_path):
    """A directory holding one saved cache: (path, its bytes, its loaded state)."""
    directory = tmp_path / "saves"
    directory.mkdir()
    path = directory / "cache.safetensors"
    save_batch_cache(path, _batch(0))
    return path, path.read_bytes(), _state_arrays(load_batch_cache(path))


def _assert_untouched(saved):
    path, data, state = saved
    assert sorted(os.listdir(path.parent)) == [path.name], "a temporary file was left behind"
    assert path.read_bytes() == data
    for got, want in zip(_state_arrays(load_batch_cache(path)), state, strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def _disk_full_half_way(monkeypatch):
    """Make the safetensors writer write half the file, then fail as a full disk does."""
    real = mx.save_safetensors

    def write_half(file, arrays, metadata=None):
        whole = io.BytesIO()
        real(whole, arrays, metadata)
        file.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        file.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(persist.mx, "save_safetensors", write_half)


def test_a_write_failing_half_way_keeps_the_previous_file(saved, monkeypatch):
    _disk_full_half_way(monkeypatch)
    with pytest.raises(OSError) as raised:
        save_batch_cache(saved[0], _batch(1))
    assert raised.value.errno == errno.ENOSPC
    _assert_untouched(saved)


def test_a_failing_rename_keeps_the_previous_file(saved, monkeypatch):
    def refuse(src, dst):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError) as raised:
        save_batch_cache(saved[0], _batch(1))
    assert raised.value.errno == errno.EIO
    _assert_untouched(saved)


def test_a_failed_first_save_leaves_no_file(tmp_path, monkeypatch):
    _disk_full_half_way(monkeypatch)
    with pytest.raises(OSError):
        save_batch_cache(tmp_path / "cache", _batch(1))
    assert os.listdir(tmp_path) == []


def test_a_save_replaces_the_file_keeping_its_permissions(saved):
    path = saved[0]
    os.chmod(path, 0o600)
    save_batch_cache(path, _batch(1))
    assert sorted(os.listdir(path.parent)) == [path.name]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for got, want in zip(_state_arrays(load_batch_cache(path)), _state_arrays(_batch(1))):
        assert np.array_equal(got, want)


def test_a_save_through_a_symlink_replaces_the_file_it_names(saved):
    path = saved[0]
    link = path.parent / "link"
    link.symlink_to(path.name)
    save_batch_cache(link, _batch(1))
    assert link.is_symlink()
    assert load_batch_cache(path).offset.tolist() == _batch(1).offset.tolist()
