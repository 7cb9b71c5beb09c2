"""Save a batch cache to a ``.safetensors`` file and restore it, codecs included.

The file holds the packed state arrays (written slots only) and, as string
metadata, ``meta_state``: written end, bits, seed, per-side bits and head
dims. Codecs are not stored; they are rebuilt from (head_dim, bits, seed).
Both functions take the path as given, with or without a suffix. A save is
atomic: it writes a temporary file beside the target, syncs it and renames it
over the target, so a save that fails part-way leaves the previous file as it
was and no temporary file behind. A file that
is not one of these (unreadable, truncated, foreign, or with metadata or
arrays that do not hold together) raises ``ValueError`` naming the file and
what was wrong; the cache's own checks (``tqbatch._validate``) run on what
it holds before any codec is built.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tqbatch.cache import BatchTurboQuantKVCache

_META_KEY = "tqbatch.meta_state"
_FORMAT = "safetensors"


def save_batch_cache(path: str | Path, cache: BatchTurboQuantKVCache) -> None:
    """Write ``cache`` to ``path`` (safetensors; written exactly there, suffix or not).

    Atomic: the previous file at ``path`` is replaced only once the new one is
    complete on disk; any failure removes the temporary file and propagates.
    """
    keys, values, offset, left_padding = cache.state
    arrays = dict(tree_flatten({"offset": offset, "left_padding": left_padding}))
    if keys is not None:
        arrays.update(tree_flatten({"keys": list(keys), "values": list(values)}))
    metadata = {_META_KEY: json.dumps(list(cache.meta_state))}
    # Resolved, so that a symlink goes on naming the file it named (as the old
    # in-place write through it did), and the temporary file is created in the
    # target's own directory: os.replace is atomic only within one filesystem.
    target = os.path.realpath(path)
    directory, name = os.path.split(target)
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
    # Through a file object: given a name, MLX appends ".safetensors" to one
    # without that suffix, and the file would not be where we said. Opened
    # exclusively and before the ``try``: a name that is taken is not ours to remove.
    f = open(temporary, "xb")
    try:
        with f:
            mx.save_safetensors(f, arrays, metadata)
            f.flush()
            os.fsync(f.fileno())
        _keep_mode(target, temporary)
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _keep_mode(target: str, temporary: str) -> None:
    """Give the new file the permissions of the one it replaces, as writing in place did."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return  # a new file: ``open`` already applied the umask
    os.chmod(temporary, mode)


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable, where the platform lets a directory be synced."""
    if os.name != "posix":
        return  # Windows cannot open a directory for fsync
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. a directory we may write to but not read
    try:
        os.fsync(fd)
    except OSError as err:
        # Some filesystems do not sync directories; the file itself is synced.
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def load_batch_cache(path: str | Path) -> BatchTurboQuantKVCache:
    """Read a cache written by :func:`save_batch_cache`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        arrays, metadata = mx.load(str(path), format=_FORMAT, return_metadata=True)
        mx.eval(list(arrays.values()))  # loading is lazy: a truncated file fails here
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    if _META_KEY not in metadata:
        raise ValueError(f"{path} was not written by tqbatch.save_batch_cache (no {_META_KEY})")
    try:
        meta_state = json.loads(metadata[_META_KEY])
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: {_META_KEY} is not JSON ({err})") from None
    if not isinstance(meta_state, list) or not all(isinstance(f, str) for f in meta_state):
        raise ValueError(f"{path}: {_META_KEY} must be a list of strings, got {meta_state!r}")
    expected = {"offset", "left_padding"}
    missing = sorted(expected - set(arrays))
    if missing:
        raise ValueError(f"{path}: the file lacks the arrays {missing}")
    states = []
    for name in ("keys", "values"):
        present = sorted(k for k in arrays if k.split(".")[0] == name)
        if not present:
            states.append(None)
        elif present != [f"{name}.0", f"{name}.1"]:
            raise ValueError(
                f"{path}: {name} must be the two arrays (norms, indices) {name}.0 and "
                f"{name}.1; the file has {present}"
            )
        else:
            states.append([arrays[f"{name}.0"], arrays[f"{name}.1"]])
    state = (*states, arrays["offset"], arrays["left_padding"])
    try:
        return BatchTurboQuantKVCache.from_state(state, tuple(meta_state))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None
