"""The codecs of the per-request references: built once per process where nothing but the
configuration decides them.

A ``TurboQuantKVCache(bits, seed, key_bits, value_bits)`` builds its key and
value codecs on its first tokens. At an integer width a codec is fixed by
(width, head dim, seed): the same one for every reference of every example.
:func:`reference_codecs` builds those once per process and hands every
reference the same pair; a fractional width splits the channels by the
first tokens' magnitudes, so those are built per reference, from its
tokens.

Shared codecs are read-only: the references only quantize and dequantize
through them (``tqbatch.testing.oracles.codec_round_trip``) and read their tables
(``tqbatch.testing.oracles.rounding``); ``tests/unit/test_reference_codecs.py``
shows their arrays unchanged after use. They are never the target's: the
target builds its own. mlx-vlm itself hands every codec it builds the same
rotation, sign and codebook arrays (``lru_cache``), and MLX writes in place
through ``a[i] = v`` to every holder of an array; so a shared codec holds
its own copies of them, and a target writing into its codec's tables after
the references were built cannot change what they compare with.
"""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx
from mlx_vlm.turboquant import TurboQuantKVCache, resolve_kv_bits

__all__ = ["reference_codecs"]


def reference_codecs(config: dict, keys: mx.array, values: mx.array) -> tuple:
    """(key codec, value codec) of a ``TurboQuantKVCache(**config)`` whose first tokens are
    (1, H, T, D) ``keys`` and ``values``."""
    _, key_bits, value_bits = resolve_kv_bits(
        config["bits"], config.get("key_bits"), config.get("value_bits")
    )
    if _integer(key_bits) and _integer(value_bits):
        return _shared_codecs(
            config["bits"],
            config["seed"],
            config.get("key_bits"),
            config.get("value_bits"),
            keys.shape[-1],
            values.shape[-1],
        )
    return _built(config, keys[:, :, :1], values[:, :, :1])


def _integer(width: float) -> bool:
    return math.isclose(width, round(width), abs_tol=1e-6)


@cache
def _shared_codecs(bits, seed, key_bits, value_bits, key_dim: int, value_dim: int) -> tuple:
    """The codecs of an integer-width configuration, each holding copies of its arrays."""
    config = dict(bits=bits, seed=seed, key_bits=key_bits, value_bits=value_bits)
    codecs = _built(config, mx.zeros((1, 1, 1, key_dim)), mx.zeros((1, 1, 1, value_dim)))
    for codec in codecs:
        for name, value in vars(codec).items():
            if isinstance(value, mx.array):
                setattr(codec, name, mx.array(value))  # a copy: see the module docstring
        mx.eval([v for v in vars(codec).values() if isinstance(v, mx.array)])
    return codecs


def _built(config: dict, keys: mx.array, values: mx.array) -> tuple:
    """The codecs a ``TurboQuantKVCache(**config)`` builds for these first tokens."""
    probe = TurboQuantKVCache(**config)
    probe._ensure_codecs(keys, values)
    return probe.key_codec, probe.value_codec
