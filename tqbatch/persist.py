"""Save a batch cache to a ``.safetensors`` file and restore it, codecs included.

The file holds the packed state arrays (written slots only) and, as string
metadata, ``meta_state``: written end, bits, seed, per-side bits and head
dims. Codecs are not stored; they are rebuilt from (head_dim, bits, seed).
Both functions take the path as given, with or without a suffix. A file that
is not one of these (unreadable, truncated, foreign, or with metadata or
arrays that do not hold together) raises ``ValueError`` naming the file and
what was wrong; the cache's own checks (``tqbatch._validate``) run on what
it holds before any codec is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tqbatch.cache import BatchTurboQuantKVCache

_META_KEY = "tqbatch.meta_state"
_FORMAT = "safetensors"


def save_batch_cache(path: str | Path, cache: BatchTurboQuantKVCache) -> None:
    """Write ``cache`` to ``path`` (safetensors; written exactly there, suffix or not)."""
    keys, values, offset, left_padding = cache.state
    arrays = dict(tree_flatten({"offset": offset, "left_padding": left_padding}))
    if keys is not None:
        arrays.update(tree_flatten({"keys": list(keys), "values": list(values)}))
    metadata = {_META_KEY: json.dumps(list(cache.meta_state))}
    # Through a file object: given a name, MLX appends ".safetensors" to one
    # without that suffix, and the file would not be where the caller said.
    with open(path, "wb") as f:
        mx.save_safetensors(f, arrays, metadata)


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
