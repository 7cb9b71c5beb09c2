"""Everything that enters a batch cache from outside, checked before anything is built or touched.

Constructor arguments, ``update_and_fetch`` inputs, ``state``, ``meta_state``
and saved files all pass through here first: kinds (``TypeError``), then
values, ranges and shapes against each other and against what a codec would
need (``ValueError``). The messages name the field, the value and what was
expected. Nothing here builds a codec, so a rejection costs microseconds
however large the numbers (building a codec for head_dim 4096 takes ~24 s,
for 16 bits ~100 s), and a rejected call leaves the cache as it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

import mlx.core as mx

__all__ = [
    "MAX_BITS",
    "MAX_HEAD_DIM",
    "MAX_SEED",
    "bits",
    "head_dim",
    "int_list",
    "kv",
    "meta_state",
    "packed",
    "padding_list",
    "seed",
    "side_bits",
]

# TurboQuant's codebooks exist for 1-8 bits per coordinate (mlx-vlm accepts
# more and spends minutes building a 2**16-entry codebook).
MAX_BITS = 8
# Head dims in use are 64-256 (512 in a few global-attention layers); the
# codec's dense rotation is head_dim x head_dim and its build time grows fast.
MAX_HEAD_DIM = 1024
# Seeds travel as int64 in arrays and files; the value codec uses seed + 1.
MAX_SEED = 2**63 - 2

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
# mlx-vlm writes float16 norms; float32 holds them exactly. Anything else
# would dequantize silently wrong.
NORM_DTYPES = (mx.float16, mx.float32)


def _dtype(a) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def _real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _integer(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def bits(value, name: str = "bits") -> float:
    """Bits per coordinate: 1 to 8, integers and halves."""
    value = _real(value, name)
    if not 1 <= value <= MAX_BITS or value * 2 != round(value * 2):
        raise ValueError(f"{name}={value:g}: expected 1 to {MAX_BITS} in steps of 0.5")
    return value


def side_bits(value, name: str) -> float | None:
    """Per-side bits (``key_bits``/``value_bits``): None, or an integer 1 to 8.

    Fractional per-side bits make mlx-vlm pick outlier channels from the first
    tensor it sees: two requests would get different codecs and could not share
    a batch.
    """
    if value is None:
        return None
    value = _real(value, name)
    if value != round(value):
        raise ValueError(
            f"{name}={value:g}: per-side bits must be integers (fractional per-side codecs "
            "depend on the data and are not reproducible)"
        )
    if not 1 <= value <= MAX_BITS:
        raise ValueError(f"{name}={value:g}: expected an integer from 1 to {MAX_BITS}")
    return value


def seed(value, name: str = "seed") -> int:
    value = _integer(value, name)
    if not 0 <= value <= MAX_SEED:
        raise ValueError(f"{name}={value}: expected 0 to {MAX_SEED} (int64, seed + 1 included)")
    return value


def head_dim(value, name: str) -> int:
    value = _integer(value, name)
    if not 1 <= value <= MAX_HEAD_DIM:
        raise ValueError(f"{name} is {value}: expected 1 to {MAX_HEAD_DIM}")
    return value


def int_list(values, name: str, *, length: int | None = None) -> list[int]:
    """``values`` as a list of Python ints, or a ValueError/TypeError naming ``name``."""
    if isinstance(values, mx.array):
        values = values.tolist()
    elif hasattr(values, "tolist"):  # numpy arrays
        values = values.tolist()
    if isinstance(values, Integral) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise TypeError(f"{name} must contain ints, got {v!r}")
        out.append(int(v))
    if length is not None and len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries, the batch has {length} rows")
    return out


def padding_list(values, name: str, *, length: int | None = None) -> list[int]:
    out = int_list(values, name, length=length)
    negative = [v for v in out if v < 0]
    if negative:
        raise ValueError(f"{name} must be non-negative, got {out}")
    return out


def kv(
    keys, values, batch_size: int, heads: int | None, key_dim: int | None, value_dim: int | None
):
    """``update_and_fetch`` inputs against the cache's rows, heads and codec head dims."""
    for name, a in (("keys", keys), ("values", values)):
        if not isinstance(a, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
        if a.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} have dtype {_dtype(a)}; expected float16, bfloat16 or float32")
        if a.ndim != 4:
            raise ValueError(f"{name} must be (B, H, T, D); got shape {tuple(a.shape)}")
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree on (B, H, T)"
        )
    B, H, T, _ = keys.shape
    if B != batch_size:
        raise ValueError(f"keys have {B} rows, the cache has {batch_size}")
    if T < 1:
        raise ValueError("update_and_fetch needs at least one token (T >= 1)")
    if H < 1:
        raise ValueError("keys have 0 heads")
    if heads is not None and H != heads:
        raise ValueError(f"keys have {H} heads, the cache holds {heads}")
    for name, a, known in (("keys", keys, key_dim), ("values", values, value_dim)):
        dim = head_dim(a.shape[3], f"{name} head_dim")
        if known is not None and dim != known:
            raise ValueError(f"{name} have head_dim {dim}, the cache's codec has {known}")


def packed(state, name: str):
    """A packed MSE state (norms (B, H, T), indices (B, H, T, W) uint32), kinds and shapes."""
    fields = getattr(state, "_fields", None)
    if fields is not None and tuple(fields) != ("norms", "indices"):
        raise TypeError(
            f"state {name}: a {type(state).__name__} with fields {fields}; tqbatch holds "
            "TurboQuant MSE states (norms, indices)"
        )
    norms, indices = state
    for field, a in (("norms", norms), ("indices", indices)):
        if not isinstance(a, mx.array):
            raise TypeError(
                f"state {name} {field} must be an mlx.core.array, got {type(a).__name__}"
            )
    if indices.dtype != mx.uint32:
        raise TypeError(f"state {name} indices have dtype {_dtype(indices)}; expected uint32")
    if norms.dtype not in NORM_DTYPES:
        raise TypeError(
            f"state {name} norms have dtype {_dtype(norms)}; expected float16 (or float32)"
        )
    if indices.ndim != 4 or norms.ndim != 3 or tuple(norms.shape) != tuple(indices.shape[:3]):
        raise ValueError(
            f"state {name}: norms {tuple(norms.shape)} and indices {tuple(indices.shape)} are "
            "not (B, H, T) and (B, H, T, W)"
        )
    if indices.shape[1] < 1 or indices.shape[3] < 1:
        raise ValueError(f"state {name} indices {tuple(indices.shape)} hold no heads or words")


def _field(value, name: str, parse, what: str = "a number"):
    if not isinstance(value, (str, Real)) or isinstance(value, bool):
        raise TypeError(f"meta_state {name} must be a string, got {type(value).__name__}")
    try:
        return parse(value)
    except (ValueError, OverflowError):
        raise ValueError(f"meta_state {name} is {value!r}: not {what}") from None


def _int_field(value, name: str) -> int:
    def parse(v):
        if isinstance(v, float) and v != int(v):
            raise ValueError(v)
        return int(v)

    return _field(value, name, parse, "an integer")


def meta_state(value) -> tuple:
    """``meta_state`` fields parsed and range-checked, no codec built.

    Returns (written end, bits, seed, key bits, value bits, key head_dim,
    value head_dim, right padding or None); head dims are 0 when unknown (an
    empty cache), and then both are.
    """
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"meta_state must be a tuple of 8 strings, got {type(value).__name__}")
    if len(value) != 8:
        raise ValueError(
            f"meta_state must have 8 fields as returned by .meta_state, got {len(value)}"
        )
    end, b, s, kb, vb, kd, vd, pending = value
    end = _int_field(end, "written end")
    if end < 0:
        raise ValueError(f"meta_state written end must be non-negative, got {end}")
    b = bits(_field(b, "bits", float), "meta_state bits")
    s = seed(_int_field(s, "seed"), "meta_state seed")
    kb = side_bits(_field(kb, "key_bits", float), "meta_state key_bits")
    vb = side_bits(_field(vb, "value_bits", float), "meta_state value_bits")
    kd, vd = _int_field(kd, "key head_dim"), _int_field(vd, "value head_dim")
    if (kd == 0) != (vd == 0):
        raise ValueError(f"meta_state head dims {kd} and {vd}: both known or both 0")
    if kd:
        head_dim(kd, "meta_state key head_dim")
        head_dim(vd, "meta_state value head_dim")
    if not isinstance(pending, str):
        raise TypeError(f"meta_state right padding must be a string, got {type(pending).__name__}")
    right = None
    if pending:
        right = [_int_field(p, "right padding") for p in pending.split(",")]
        if any(p < 0 for p in right):
            raise ValueError(f"meta_state right padding must be non-negative, got {right}")
    return end, b, s, kb, vb, kd, vd, right
