"""Save a batch cache to a ``.safetensors`` file and restore it, codecs included.

The file holds the packed state arrays (written slots only) and, as string
metadata, ``meta_state``: written end, bits, seed, per-side bits and head
dims. Codecs are not stored; they are rebuilt from (head_dim, bits, seed).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from tqbatch.cache import BatchTurboQuantKVCache

_META_KEY = "tqbatch.meta_state"


def save_batch_cache(path: str | Path, cache: BatchTurboQuantKVCache) -> None:
    """Write ``cache`` to ``path`` (a ``.safetensors`` file)."""
    keys, values, offset, left_padding = cache.state
    arrays = dict(tree_flatten({"offset": offset, "left_padding": left_padding}))
    if keys is not None:
        arrays.update(tree_flatten({"keys": list(keys), "values": list(values)}))
    mx.save_safetensors(str(path), arrays, {_META_KEY: json.dumps(list(cache.meta_state))})


def load_batch_cache(path: str | Path) -> BatchTurboQuantKVCache:
    """Read a cache written by :func:`save_batch_cache`."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    if _META_KEY not in metadata:
        raise ValueError(f"{path} was not written by tqbatch.save_batch_cache")
    meta_state = tuple(json.loads(metadata[_META_KEY]))
    tree = tree_unflatten(list(arrays.items()))
    state = (tree.get("keys"), tree.get("values"), tree["offset"], tree["left_padding"])
    return BatchTurboQuantKVCache.from_state(state, meta_state)
