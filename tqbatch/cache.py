"""``BatchTurboQuantKVCache``: many requests' TurboQuant KV state in one tensor.

Geometry follows mlx-lm's ``BatchKVCache`` exactly. Rows are right-aligned on
a shared *written end* (``size()``); row ``b`` holds ``left_padding[b]`` dead
slots and then its ``offset[b]`` tokens, so ``offset == size() - left_padding``
at all times. Writes land at the written end, which is tracked explicitly:
it is neither ``max(offset)`` (short of the end once the unpadded row is
filtered away, omlx #2172) nor the allocated capacity (past the end after
growth).

All reshaping (merge, extend, filter, extract, finalize, trim) moves packed
bits and never re-quantizes, so a row always holds exactly the bits that a
single ``TurboQuantKVCache`` with the same bits and seed would hold for that
request alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from numbers import Integral

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import cache as lm_cache
from mlx_lm.models.base import create_causal_mask
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.turboquant import (
    TurboQuantKVCache,
    TurboQuantMSEState,
    _QuantizedStateProxy,
)

from tqbatch import _codec, _cuda_decode, _masks, _packed, _validate
from tqbatch._devices import metal_kernels_here, mlx_vlm_follows_device

__all__ = ["BatchTurboQuantKVCache", "BatchableTurboQuantKVCache"]

# Full-precision caches a batch accepts and quantizes on the way in, as
# ``TurboQuantKVCache.from_cache`` would. Exact classes: a subclass may keep
# another window of tokens (mlx-lm's ChunkedKVCache drops old ones).
FULL_PRECISION_SINGLES = (lm_cache.KVCache, vlm_cache.KVCache)
FULL_PRECISION_BATCHES = (lm_cache.BatchKVCache, vlm_cache.BatchKVCache)

# (base class, config) -> configured subclass; see BatchTurboQuantKVCache.configured.
_CONFIGURED: dict[tuple[type, tuple], type] = {}


def _config_of(cache: TurboQuantKVCache) -> tuple:
    return (cache.bits, cache.key_bits, cache.value_bits, cache.seed)


def _name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__name__}"


def _quantized_single(cache, config: tuple, what: str) -> TurboQuantKVCache:
    """A full-precision single cache's tokens in a ``TurboQuantKVCache`` of ``config``.

    As ``TurboQuantKVCache.from_cache`` does: the written tokens are quantized
    at once, as ``update_and_fetch`` would write them, and quantization is per
    token, so each token gets the codes it would have got written one at a time.
    """
    bits, key_bits, value_bits, seed = config
    single = TurboQuantKVCache(bits=bits, seed=seed, key_bits=key_bits, value_bits=value_bits)
    # Read the attributes, not ``state``: mlx-lm's KVCache.state is (keys,
    # values, offset) over the whole allocation, mlx-vlm's the written slots.
    written = int(cache.offset)
    if cache.keys is None or written == 0:
        return single
    keys, values = cache.keys[..., :written, :], cache.values[..., :written, :]
    if keys.ndim != 4 or keys.shape[0] != 1 or values.shape[:3] != keys.shape[:3]:
        raise ValueError(
            f"{what} holds keys {keys.shape} and values {values.shape}; a single-request "
            "cache holds (1, H, T, D)"
        )
    # update_and_fetch's writes, through tqbatch's codec ops: off Metal, mlx-vlm's
    # own would pack with a Python loop over the coordinates (milliseconds a member).
    single._ensure_codecs(keys, values)
    single.keys, single.values = _quantized_states(single, keys, values)
    single.offset = written
    return single


def _quantized_states(cache: TurboQuantKVCache, keys: mx.array, values: mx.array):
    """The packed states of (B, H, T, D) keys and values under ``cache``'s codecs, bit for bit
    those mlx-vlm's ``update_and_fetch`` writes."""
    # mlx-vlm's fused key+value write is a Metal kernel: only where the work runs there.
    if metal_kernels_here():
        new_keys, new_values = cache._try_fused_kv_quantize(keys, values)
        if new_keys is not None:
            return new_keys, new_values
    return _codec.quantize(cache.key_codec, keys), _codec.quantize(cache.value_codec, values)


def _check_packed_width(codec, state, name: str):
    """A packed state's index width is the one ``codec`` writes, or a ValueError."""
    if codec is None:
        raise ValueError(f"no head_dim is known for the state's {name}")
    width = (codec.dim * codec.bits + 31) // 32
    if state.indices.shape[-1] != width:
        raise ValueError(
            f"head_dim {codec.dim} at {codec.bits} bits needs packed width {width}; "
            f"the state's {name} have {state.indices.shape[-1]}"
        )


def _parse_meta_state(value) -> tuple[int, TurboQuantKVCache, list[int] | None]:
    """(written end, a probe cache holding the configuration and codecs, right padding).

    Every field is checked (``_validate.meta_state``) before a codec is built.
    """
    end, bits, seed, key_bits, value_bits, key_dim, value_dim, right = _validate.meta_state(value)
    probe = TurboQuantKVCache(bits=bits, seed=seed, key_bits=key_bits, value_bits=value_bits)
    if key_dim > 0:
        probe._ensure_codecs(mx.zeros((1, 1, 1, key_dim)), mx.zeros((1, 1, 1, value_dim)))
    return end, probe, right


def _restore_pickled(cls):
    return cls.__new__(cls)


def _unwrap(state):
    return state._state if isinstance(state, _QuantizedStateProxy) else state


def _mask_array(mask, n_queries: int):
    """``mask`` as mlx-vlm's attention paths take it: causal rows become their array."""
    return mask.allowed(n_queries) if isinstance(mask, _masks.CausalRows) else mask


def _as_packed(state):
    """Accept a packed state, or the plain nested lists a serializer leaves behind."""
    state = _unwrap(state)
    if state is None or isinstance(state, tuple) and hasattr(state, "_fields"):
        return state
    # tree_unflatten after save/load turns NamedTuples into lists; this cache
    # only builds MSE codecs (integer key/value bits), so the state is MSE.
    if isinstance(state, (list, tuple)) and len(state) == 2:
        return TurboQuantMSEState(*state)
    raise TypeError(f"not a TurboQuant packed state: {type(state).__name__}")


def _checked_packed(state, name: str):
    """``_as_packed`` plus kinds and shapes (``_validate.packed``)."""
    state = _as_packed(state)
    if state is not None:
        _validate.packed(state, name)
    return state


class BatchTurboQuantKVCache(TurboQuantKVCache):
    """A TurboQuant KV cache holding a batch of requests, for continuous batching.

    Drop-in beside mlx-lm's ``BatchKVCache``: same constructor, ``prepare`` /
    ``finalize``, ``merge`` / ``extend`` / ``filter`` / ``extract``, ``trim``,
    ``make_mask`` and geometry (``offset``, ``left_padding``, ``size()``).
    ``update_and_fetch`` returns packed states that
    ``mlx_vlm.models.base.scaled_dot_product_attention`` consumes.

    Args:
        left_padding: dead slots at the start of each row; its length is the
            batch size.
        bits: TurboQuant bits per coordinate (1 to 8, integers and halves).
        seed: codec seed; rows quantize exactly as a ``TurboQuantKVCache``
            with the same ``bits`` and ``seed``.
        key_bits, value_bits: integer overrides of the per-side bits.

    Every instance's class is ``BatchTurboQuantKVCache.configured(...)`` for
    its configuration (a subclass; ``isinstance`` checks are unaffected), so
    ``type(cache).merge`` can quantize full-precision members even when none
    of them carries a configuration.
    """

    # Set on the subclasses that ``configured`` builds.
    _configuration: tuple | None = None

    def __init__(
        self,
        left_padding: Sequence[int],
        bits: float = 4.0,
        seed: int = 0,
        *,
        key_bits: float | None = None,
        value_bits: float | None = None,
    ):
        padding = _validate.padding_list(left_padding, "left_padding")
        if not padding:
            raise ValueError("left_padding must have one entry per row; got an empty list")
        bits, seed = _validate.bits(bits), _validate.seed(seed)
        key_bits = _validate.side_bits(key_bits, "key_bits")
        value_bits = _validate.side_bits(value_bits, "value_bits")
        super().__init__(bits=bits, seed=seed, key_bits=key_bits, value_bits=value_bits)
        self.left_padding = mx.array(padding, dtype=mx.int32)
        self.offset = -self.left_padding
        self._end = 0  # written physical end; never named `_idx` (mlx-vlm rollback keys on it)
        self._right_padding: mx.array | None = None
        self._restoring: tuple | None = None  # meta_state awaiting its state
        self._retype()

    # ------------------------------------------------------------------ configuration

    @classmethod
    def configured(
        cls,
        bits: float = 4.0,
        seed: int = 0,
        *,
        key_bits: float | None = None,
        value_bits: float | None = None,
    ) -> type:
        """This class bound to one TurboQuant configuration.

        ``configured(bits=3.5).merge(members)`` quantizes full-precision
        members at 3.5 bits. mlx-vlm's qwen3_5 relies on it without knowing:
        it runs left-padded rows alone in fresh full-precision ``KVCache``s and
        re-batches them with ``cache.__class__.merge(rows)``.
        """
        bits, seed = _validate.bits(bits), _validate.seed(seed)
        key_bits = _validate.side_bits(key_bits, "key_bits")
        value_bits = _validate.side_bits(value_bits, "value_bits")
        probe = TurboQuantKVCache(bits=bits, seed=seed, key_bits=key_bits, value_bits=value_bits)
        return cls._for_config(_config_of(probe))

    @classmethod
    def _for_config(cls, config: tuple) -> type:
        base = cls.__dict__.get("_configured_from", cls)
        key = (base, config)
        if key not in _CONFIGURED:
            namespace = {
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
                "_configuration": config,
                "_configured_from": base,
            }
            _CONFIGURED[key] = type(base.__name__, (base,), namespace)
        return _CONFIGURED[key]

    def _retype(self):
        self.__class__ = type(self)._for_config(self.config)

    def __reduce__(self):
        # Pickle by the unconfigured class (importable by name); the instance
        # dict restores the configuration and __setstate__ the class.
        base = type(self).__dict__.get("_configured_from", type(self))
        return (_restore_pickled, (base,), self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._retype()

    # ------------------------------------------------------------------ basics

    @property
    def batch_size(self) -> int:
        return self.left_padding.shape[0]

    @property
    def config(self) -> tuple:
        """(bits, key_bits, value_bits, seed): what two caches must share to be batched."""
        return _config_of(self)

    def size(self) -> int:
        """The written end: number of token slots in use, padding included."""
        return self._end

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed key and value buffers (allocated capacity)."""
        if self.keys is None:
            return 0
        return _packed.nbytes(self.keys) + _packed.nbytes(self.values)

    def _invalidate(self):
        self._cached_state = None
        self._cached_state_offset = -1
        self._restoring = None

    def _written(self):
        return (
            _packed.token_range(self.keys, 0, self._end),
            _packed.token_range(self.values, 0, self._end),
        )

    # ------------------------------------------------------------------ writes

    def _check_kv(self, keys: mx.array, values: mx.array):
        _validate.kv(
            keys,
            values,
            self.batch_size,
            _packed.heads(self.keys) if self.keys is not None else None,
            self.key_codec.dim if self.key_codec is not None else None,
            self.value_codec.dim if self.value_codec is not None else None,
        )

    def _quantize(self, keys: mx.array, values: mx.array):
        """The packed states of (B, H, T, D) keys and values, as a write stores them."""
        return _quantized_states(self, keys, values)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append ``T`` tokens to every row at the written end; return all written slots."""
        self._check_kv(keys, values)
        fresh = self.key_codec is None
        self._ensure_codecs(keys, values)
        try:
            new_keys, new_values = self._quantize(keys, values)
        except BaseException:
            if fresh:  # a failed first write leaves no codecs behind
                self.key_codec = self.value_codec = None
            raise

        start, n_new = self._end, keys.shape[2]
        end = start + n_new
        if self.keys is None:
            self.keys = _packed.zeros_like(new_keys, self.batch_size, end)
            self.values = _packed.zeros_like(new_values, self.batch_size, end)
        else:
            self.keys = _packed.grow(self.keys, start, end, self.cache_step)
            self.values = _packed.grow(self.values, start, end, self.cache_step)
        self.keys = _packed.write_tokens(self.keys, new_keys, start)
        self.values = _packed.write_tokens(self.values, new_values, start)

        self._end = end
        self.offset = self.offset + n_new
        self._invalidate()
        # Same evaluation cadence as the parent: keeps the lazy graph short.
        if n_new > 1 or end % 50 == 0:
            mx.eval(self.keys, self.values, self.offset)
        ks, vs = self._written()
        n_heads = keys.shape[1]
        return _QuantizedStateProxy(ks, end, n_heads), _QuantizedStateProxy(vs, end, n_heads)

    # ------------------------------------------------------------------ masks

    def make_mask(
        self,
        N: int,
        return_array: bool = False,
        window_size: int | None = None,
        **kwargs,
    ):
        """The (B, 1, N, size() + N) boolean mask for the next ``N`` queries, as BatchKVCache.

        The cache remembers the array (``tqbatch._masks``): passed back to its
        attention untouched, it is attended as per-row start offsets.
        """
        rows = _masks.CausalRows(self.left_padding, self._end, window_size)
        mask = create_causal_mask(
            N, offset=self._end, left_padding=self.left_padding, window_size=window_size
        )
        return _masks.remember(mask, rows)

    def _attention_mask(self, queries: mx.array, keys_state, mask):
        """The mask to attend with: ``mask``, completed where model code left it short.

        Where the mask is the cache's own causal mask over its left-padded
        rows (an array ``make_mask`` made, or one completed here), it is
        returned as ``_masks.CausalRows``: a start per row instead of a
        (B, 1, L, T) array.

        * None at decode while rows hold left padding: every written slot,
          padding included, would be attended. mlx-vlm's qwen3_5 passes None
          there and expects a path that skips caches with ``bits`` to handle
          the padding. The cache uses the mask ``make_mask(1)`` makes.
        * A boolean mask narrower than the keys, by fewer columns than every
          row's shared padding, that is exactly the first columns of the
          cache's own mask: cut short by model code that sizes it as
          ``max(offset) + 1 + L`` (mlx-vlm's qwen3_5, which reads ``_idx``
          instead where a cache has one), short once every row is padded. It
          cannot be applied as it is; the cache's own mask is those columns
          and the ones that were cut.
        """
        n = queries.shape[-2]
        if self.keys is None:
            return mask
        length = _packed.length(_unwrap(keys_state)) if keys_state is not None else self._end
        made = _masks.made_by_cache(mask)
        if made is not None and made.offset + n == length and mask.shape[-2] == n:
            return dataclasses.replace(made, array=mask)
        # Each branch reads the padding (a device sync) only on its rare path:
        # a decode step with a mask as wide as the keys costs nothing here.
        if mask is None:
            if n != 1 or not bool((self.left_padding > 0).any()):
                return mask
            return _masks.CausalRows(self.left_padding, length - 1)
        if isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape[-1] < length:
            # Sized as max(offset) + 1 + L, a mask misses min(left_padding) - 1
            # columns: never more than the padding every row shares. A mask short
            # by more is not a cut one and is left for the attention to refuse.
            if length - mask.shape[-1] < int(mx.min(self.left_padding).item()):
                own = _masks.CausalRows(self.left_padding, length - n)
                cut = own.allowed(n)[..., : mask.shape[-1]]
                if mask.shape == cut.shape and bool(mx.array_equal(mask, cut)):
                    return own
        return mask

    def _attend(self, queries, keys_state, values_state, scale, mask):
        """tqbatch's vectorized attention over the packed state, or None where not served."""
        if keys_state is None or values_state is None:
            keys_state, values_state = self._written()
        args = (
            queries,
            _unwrap(keys_state),
            _unwrap(values_state),
            self.key_codec,
            self.value_codec,
            scale,
            mask,
        )
        # On a CUDA GPU a decode step is one fused kernel (_cuda_decode says
        # where); None leaves the vectorized ops.
        out = _cuda_decode.attend(*args)
        return out if out is not None else _codec.attend(*args)

    def decode_attention(self, queries, keys_state=None, values_state=None, scale=1.0, mask=None):
        mask = self._attention_mask(queries, keys_state, mask)
        out = self._attend(queries, keys_state, values_state, scale, mask)
        if out is not None:
            return out
        mask = _mask_array(mask, queries.shape[-2])
        with mlx_vlm_follows_device():
            return super().decode_attention(queries, keys_state, values_state, scale, mask)

    def prefill_attention(self, queries, keys_state=None, values_state=None, scale=1.0, mask=None):
        mask = self._attention_mask(queries, keys_state, mask)
        out = self._attend(queries, keys_state, values_state, scale, mask)
        if out is not None:
            return out
        mask = _mask_array(mask, queries.shape[-2])
        with mlx_vlm_follows_device():
            out = super().prefill_attention(queries, keys_state, values_state, scale, mask)
        if out is not None:
            return out
        # mlx-vlm's own fallback (mlx_vlm.models.base.scaled_dot_product_attention
        # without sinks), here so that it attends with the completed mask.
        keys, values = self.dequantize(keys_state, values_state)
        return mx.fast.scaled_dot_product_attention(
            queries,
            keys.astype(queries.dtype),
            values.astype(queries.dtype),
            scale=scale,
            mask=mask,
        )

    # ------------------------------------------------------------------ prefill

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """Declare padding of the prompt about to be prefilled (BatchKVCache semantics).

        ``left_padding`` only on an empty cache; ``right_padding`` is rolled
        into left padding by ``finalize()`` after the prefill. ``lengths`` is
        accepted for interface compatibility and, as in BatchKVCache, unused.
        """
        B = self.batch_size
        if left_padding is not None:
            left = _validate.padding_list(left_padding, "left_padding", length=B)
            if self.keys is not None:
                raise ValueError(
                    "left_padding can only be prepared on an empty cache "
                    f"(this one has {self._end} written slots)"
                )
        if right_padding is not None:
            right = _validate.padding_list(right_padding, "right_padding", length=B)
        if lengths is not None:
            _validate.padding_list(lengths, "lengths", length=B)
        if left_padding is not None:
            left = mx.array(left, dtype=mx.int32)
            self.left_padding = self.left_padding + left
            self.offset = self.offset - left
        if right_padding is not None and max(right) > 0:
            self._right_padding = mx.array(right, dtype=mx.int32)

    def finalize(self):
        """Move pending right padding to the left by rolling packed rows (bit-exact)."""
        if self._right_padding is None:
            return
        padding = self._right_padding
        if self.keys is not None:
            keys, values = self._written()
            self.keys = _packed.roll_rows(keys, padding)
            self.values = _packed.roll_rows(values, padding)
            mx.eval(self.keys, self.values)
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None
        self._invalidate()

    # ------------------------------------------------------------------ batch ops

    def filter(self, batch_indices):
        """Keep the rows ``batch_indices`` (in that order) and drop shared dead columns."""
        B = self.batch_size
        keep = _validate.int_list(batch_indices, "batch_indices")
        if not keep:
            raise ValueError("filter needs at least one row index; got none")
        bad = [i for i in keep if not 0 <= i < B]
        if bad:
            raise IndexError(f"batch_indices {bad} out of range for a batch of {B} rows")
        if len(set(keep)) != len(keep):
            raise ValueError(f"batch_indices has duplicates: {keep}")

        index = mx.array(keep, dtype=mx.int32)
        left_padding = self.left_padding[index]
        # Compact: columns every survivor treats as padding are dead. Never
        # shift past the written end (an empty, left-padded cache has none).
        shift = min(min(left_padding.tolist()), self._end)
        if self.keys is not None:
            keys, values = self._written()
            self.keys = _packed.token_range(_packed.select_rows(keys, index), shift, self._end)
            self.values = _packed.token_range(_packed.select_rows(values, index), shift, self._end)
        self.offset = self.offset[index]
        self.left_padding = left_padding - shift
        if self._right_padding is not None:
            self._right_padding = self._right_padding[index]
        self._end -= shift
        self._invalidate()

    def _check_same_config(self, other: TurboQuantKVCache, op: str):
        mine, theirs = self.config, _config_of(other)
        if mine != theirs:
            raise ValueError(
                f"{op}: mixed TurboQuant configurations (bits, key_bits, value_bits, seed) "
                f"{mine} and {theirs} cannot share a batch"
            )
        for name in ("key_codec", "value_codec"):
            a, b = getattr(self, name), getattr(other, name)
            if a is not None and b is not None and a.dim != b.dim:
                raise ValueError(f"{op}: head_dim {a.dim} and {b.dim} cannot share a batch")
        if self.keys is not None and other.keys is not None:
            h1, h2 = _packed.heads(self.keys), _packed.heads(_unwrap(other.keys))
            if h1 != h2:
                raise ValueError(f"{op}: {h1} and {h2} KV heads cannot share a batch")

    def extend(self, other):
        """Append the rows of ``other``, right-aligning both on the larger written end.

        ``other`` is a ``BatchTurboQuantKVCache`` of the same configuration, or
        a full-precision ``BatchKVCache`` (mlx-lm's or mlx-vlm's, no right
        padding pending) whose written tokens are quantized with this cache's
        configuration, each row exactly as a single ``TurboQuantKVCache`` would.
        """
        if type(other) in FULL_PRECISION_BATCHES:
            other = self._quantized_batch(other)
        elif not isinstance(other, BatchTurboQuantKVCache):
            raise TypeError(
                "extend expects a BatchTurboQuantKVCache or a full-precision BatchKVCache, "
                f"got {_name(other)}"
            )
        self._check_same_config(other, "extend")

        end = max(self._end, other._end)
        sides = (self, other)
        if self.keys is not None or other.keys is not None:
            ref = self if self.keys is not None else other
            # Both sides' written slots, read before self is reassigned.
            keys, values = zip(
                *(side._written() if side.keys is not None else (None, None) for side in sides)
            )
            blocks = lambda states: [  # noqa: E731
                (state, side.batch_size, side._end) for state, side in zip(states, sides)
            ]
            template_k, template_v = ref.keys, ref.values
            self.keys = _packed.right_aligned(blocks(keys), template_k, end)
            self.values = _packed.right_aligned(blocks(values), template_v, end)
        paddings = [side.left_padding + (end - side._end) for side in sides]
        offsets = [side.offset for side in sides]
        pending = [
            side._right_padding
            if side._right_padding is not None
            else mx.zeros((side.batch_size,), dtype=mx.int32)
            for side in sides
        ]
        any_pending = self._right_padding is not None or other._right_padding is not None

        self.left_padding = mx.concatenate(paddings)
        self.offset = mx.concatenate(offsets)
        self._right_padding = mx.concatenate(pending) if any_pending else None
        self._end = end
        if self.key_codec is None:
            self.key_codec, self.value_codec = other.key_codec, other.value_codec
        self._invalidate()

    def _quantized_batch(self, dense) -> BatchTurboQuantKVCache:
        """A full-precision ``BatchKVCache`` as a batch of this configuration (new arrays)."""
        if getattr(dense, "_right_padding", None) is not None:
            raise ValueError(
                f"extend: the {type(dense).__name__} has right padding pending; "
                "call its finalize() first"
            )
        padding = _validate.padding_list(dense.left_padding, f"{type(dense).__name__} left_padding")
        converted = type(self)(
            padding,
            bits=self.bits,
            seed=self.seed,
            key_bits=self.key_bits,
            value_bits=self.value_bits,
        )
        written = int(dense._idx)
        if dense.keys is not None and written > 0:
            keys, values = dense.keys[..., :written, :], dense.values[..., :written, :]
            # Quantization is per token: padding slots get codes too, but the
            # real tokens' codes are exactly those of each request alone.
            converted.update_and_fetch(keys, values)
        drift = [
            (o, c)
            for o, c in zip(_validate.int_list(dense.offset, "offset"), converted.offset.tolist())
            if o != c
        ]
        if drift:
            raise ValueError(
                f"extend: the {type(dense).__name__}'s offsets are not its written end "
                f"minus left padding ({drift})"
            )
        return converted

    def extract(self, idx: int) -> BatchableTurboQuantKVCache:
        """Row ``idx`` as a single-request cache holding its tokens only.

        The result is a ``TurboQuantKVCache`` that also has ``merge``, so it
        can be re-inserted wherever per-request caches are batched (mlx-lm's
        ``BatchGenerator``).
        """
        if isinstance(idx, bool) or not isinstance(idx, Integral):
            raise TypeError(f"extract index must be an int, got {type(idx).__name__}")
        B = self.batch_size
        if not 0 <= idx < B:
            raise IndexError(f"extract index {idx} out of range for a batch of {B} rows")
        single = BatchableTurboQuantKVCache(
            bits=self.bits, seed=self.seed, key_bits=self.key_bits, value_bits=self.value_bits
        )
        single.key_codec, single.value_codec = self.key_codec, self.value_codec
        start = int(self.left_padding[idx].item())
        stop = self._end
        if self._right_padding is not None:
            stop -= int(self._right_padding[idx].item())
        if self.keys is None or stop <= start:
            return single
        # A contiguous copy of the row's slots: shares no buffer with the batch.
        cut = (
            lambda s: tree_map(  # noqa: E731
                lambda a: mx.contiguous(a[idx : idx + 1, :, start:stop]), s
            )
        )
        single.keys, single.values = cut(self.keys), cut(self.values)
        mx.eval(single.keys, single.values)
        single.offset = stop - start
        return single

    @classmethod
    def merge(cls, caches: Sequence) -> BatchTurboQuantKVCache:
        """Batch single-request caches, left-padding the shorter ones.

        Members are single-request TurboQuant caches (mlx-vlm's
        ``TurboQuantKVCache``, ``BatchableTurboQuantKVCache``) or full-precision
        ``KVCache``s of mlx-lm or mlx-vlm, empty or not. Full-precision tokens
        are quantized exactly as a ``TurboQuantKVCache`` of the batch's
        configuration would quantize them. That configuration is the TurboQuant
        members'; with none among them, the class's (``type(cache).merge`` or
        ``configured(...).merge``).

        Raises:
            TypeError: a member of another type (batch caches, rotating or
                affine-quantized caches), or only full-precision members and
                no configured class to say how to quantize them.
            ValueError: no members; members (or the class) of different
                configurations, KV head counts or head dims; a member with
                more than one row.
        """
        caches = list(caches)
        if not caches:
            raise ValueError("merge needs at least one cache")
        for i, c in enumerate(caches):
            single_tq = isinstance(c, TurboQuantKVCache) and not isinstance(
                c, BatchTurboQuantKVCache
            )
            if not single_tq and type(c) not in FULL_PRECISION_SINGLES:
                raise TypeError(
                    "merge expects single-request caches (mlx_vlm TurboQuantKVCache, or "
                    f"mlx-lm / mlx-vlm KVCache); member {i} is {_name(c)}"
                )
        configs = {_config_of(c) for c in caches if isinstance(c, TurboQuantKVCache)}
        if cls._configuration is not None:
            configs.add(cls._configuration)
        if len(configs) > 1:
            raise ValueError(
                "merge: mixed TurboQuant configurations (bits, key_bits, value_bits, seed) "
                f"{sorted(configs)} cannot share a batch"
            )
        if not configs:
            raise TypeError(
                "merge: every member is a full-precision KVCache and this class has no "
                "TurboQuant configuration to quantize them with; call type(batch).merge or "
                "BatchTurboQuantKVCache.configured(bits=..., seed=...).merge"
            )
        config = configs.pop()
        for i, c in enumerate(caches):
            if isinstance(c, TurboQuantKVCache) and c.keys is not None:
                rows = _packed.rows(_unwrap(c.keys))
                if rows != 1:
                    raise ValueError(f"merge: member {i} holds {rows} rows, not one")
        # Members are never modified: full-precision ones are copied into new caches.
        caches = [
            c
            if isinstance(c, TurboQuantKVCache)
            else _quantized_single(c, config, f"merge: member {i} ({_name(c)})")
            for i, c in enumerate(caches)
        ]
        bits, key_bits, value_bits, seed = config
        lengths = [int(c.offset) if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        batch = cls(
            [longest - n for n in lengths],
            bits=bits,
            seed=seed,
            key_bits=key_bits,
            value_bits=value_bits,
        )
        with_codecs = [c for c in caches if c.key_codec is not None]
        for c in with_codecs:
            batch._check_same_config(c, "merge")
            if batch.key_codec is None:
                batch.key_codec, batch.value_codec = c.key_codec, c.value_codec
        if longest == 0:
            return batch

        filled = [(c, n) for c, n in zip(caches, lengths) if n > 0]
        heads = {_packed.heads(_unwrap(c.keys)) for c, _ in filled}
        if len(heads) > 1:
            raise ValueError(f"merge: members have different KV head counts {sorted(heads)}")
        ref_k = _unwrap(filled[0][0].keys)
        ref_v = _unwrap(filled[0][0].values)
        batch.keys = _packed.right_aligned(
            [(_unwrap(c.keys) if n else None, 1, n) for c, n in zip(caches, lengths)],
            ref_k,
            longest,
        )
        batch.values = _packed.right_aligned(
            [(_unwrap(c.values) if n else None, 1, n) for c, n in zip(caches, lengths)],
            ref_v,
            longest,
        )
        batch._end = longest
        batch.offset = batch.offset + longest
        mx.eval(batch.keys, batch.values, batch.offset)
        return batch

    # ------------------------------------------------------------------ rollback

    def trim(self, n: int) -> int:
        """Drop the last ``n`` written slots of every row (speculative rollback)."""
        if isinstance(n, bool) or not isinstance(n, Integral) or n < 0:
            raise ValueError(f"trim needs a non-negative int, got {n!r}")
        if self._right_padding is not None:
            raise ValueError("trim: right padding is pending; call finalize() first")
        n = min(int(n), self._end)
        self._end -= n
        self.offset = self.offset - n
        self._invalidate()
        return n

    # ------------------------------------------------------------------ read-out

    def dequantize(self, keys_state=None, values_state=None):
        """Float32 (keys, values) of shape (B, H, size(), D), padding slots included."""
        if keys_state is None or values_state is None:
            if self.keys is None:
                raise ValueError("dequantize: the cache is empty")
            keys_state, values_state = self._written()
        keys = _codec.dequantize(self.key_codec, _unwrap(keys_state)).astype(mx.float32)
        values = _codec.dequantize(self.value_codec, _unwrap(values_state)).astype(mx.float32)
        return keys, values

    def dequantize_for_apc(self):
        if self.keys is None or self._end == 0:
            return None, None
        return self.dequantize()

    # ------------------------------------------------------------------ persistence

    @property
    def state(self):
        """(keys, values, offset, left_padding): written slots only, as new arrays."""
        if self.keys is None:
            return None, None, mx.array(self.offset), mx.array(self.left_padding)
        keys, values = self._written()
        return keys, values, mx.array(self.offset), mx.array(self.left_padding)

    @state.setter
    def state(self, value):
        if value is None or len(value) != 4:
            raise ValueError(
                "state must be (keys, values, offset, left_padding) as returned by .state"
            )
        keys, values, offset, left_padding = value
        keys, values = _checked_packed(keys, "keys"), _checked_packed(values, "values")
        offset = _validate.int_list(offset, "state offset")
        left_padding = _validate.padding_list(
            left_padding, "state left_padding", length=len(offset)
        )
        if not offset:
            raise ValueError("state has no rows")
        if (keys is None) != (values is None):
            raise ValueError("state must have both keys and values, or neither")
        end = _packed.length(keys) if keys is not None else 0
        if keys is not None:
            for name, s in (("keys", keys), ("values", values)):
                if _packed.rows(s) != len(offset):
                    raise ValueError(
                        f"state {name} have {_packed.rows(s)} rows, offset has {len(offset)}"
                    )
            shapes = [(_packed.heads(s), _packed.length(s)) for s in (keys, values)]
            if shapes[0] != shapes[1]:
                raise ValueError(
                    f"state keys and values disagree on (heads, slots): {shapes[0]} vs {shapes[1]}"
                )
        drift = [o for o, lp in zip(offset, left_padding) if o != end - lp]
        if drift:
            raise ValueError(
                f"state offset {offset} is inconsistent with left_padding {left_padding} "
                f"and written end {end} (offset must equal end - left_padding)"
            )
        right = None
        restoring = getattr(self, "_restoring", None)
        if restoring is not None:  # meta_state came first (omlx's order): hold the state to it
            meta_end, right = restoring
            if end != meta_end:
                raise ValueError(
                    f"state has written end {end}; the meta_state set before it says {meta_end}"
                )
            if right is not None and len(right) != len(offset):
                raise ValueError(
                    f"the meta_state set before this state has right padding {right} "
                    f"for {len(right)} rows; the state has {len(offset)}"
                )
            if keys is not None:
                _check_packed_width(self.key_codec, keys, "keys")
                _check_packed_width(self.value_codec, values, "values")
        elif keys is not None and getattr(self, "key_codec", None) is not None:
            # Codecs already built (a live cache): the state must be in their layout.
            _check_packed_width(self.key_codec, keys, "keys")
            _check_packed_width(self.value_codec, values, "values")
        self.keys = _packed.detach(keys) if keys is not None else None
        self.values = _packed.detach(values) if values is not None else None
        self.offset = mx.array(offset, dtype=mx.int32)
        self.left_padding = mx.array(left_padding, dtype=mx.int32)
        self._end = end
        self._right_padding = mx.array(right, dtype=mx.int32) if right is not None else None
        if not hasattr(self, "key_codec"):  # created by from_state without __init__
            self.key_codec = self.value_codec = None
        self._invalidate()

    @property
    def meta_state(self):
        """Strings: written end, bits, seed, key/value bits, key/value head_dim, right padding.

        The head dims let a restore rebuild the codecs exactly; the pending
        right padding (comma-separated, empty if none) keeps a prefill that
        was saved between ``prepare`` and ``finalize`` whole.
        """
        dims = [c.dim if c is not None else 0 for c in (self.key_codec, self.value_codec)]
        pending = (
            ",".join(str(p) for p in self._right_padding.tolist())
            if self._right_padding is not None
            else ""
        )
        return tuple(
            map(str, (self._end, self.bits, self.seed, self.key_bits, self.value_bits, *dims))
        ) + (pending,)

    @meta_state.setter
    def meta_state(self, value):
        """Set after ``state`` (mlx-vlm's ``from_state``), or before it (omlx's restore).

        After: the meta_state must describe the state held. Before, or on an
        empty cache: the configuration (bits, seed, codecs) is taken now, and
        the next ``state`` must have the written end and row count it names.
        Either way a rejected meta_state changes nothing.
        """
        end, probe, right = _parse_meta_state(value)
        keys = getattr(self, "keys", None)
        if keys is not None:
            capacity = _packed.length(keys)
            implied = {o + lp for o, lp in zip(self.offset.tolist(), self.left_padding.tolist())}
            if end > capacity or implied != {end}:
                raise ValueError(
                    f"meta_state written end {end} does not match the state "
                    f"({capacity} slots, offset + left_padding = {sorted(implied)})"
                )
            if right is not None and len(right) != self.batch_size:
                raise ValueError(
                    f"meta_state right padding {right} does not match {self.batch_size} rows"
                )
            if probe.key_codec is None:
                raise ValueError("meta_state lacks head_dim for a non-empty state")
            _check_packed_width(probe.key_codec, keys, "keys")
            _check_packed_width(probe.value_codec, self.values, "values")
        elif "left_padding" not in vars(self):  # made by __new__: start from an empty row
            BatchTurboQuantKVCache.__init__(
                self,
                [0],
                bits=probe.bits,
                seed=probe.seed,
                key_bits=probe.key_bits,
                value_bits=probe.value_bits,
            )
        elif end == 0 and right is not None and len(right) != self.batch_size:
            raise ValueError(
                f"meta_state right padding {right} does not match {self.batch_size} rows"
            )
        self.bits, self.key_bits, self.value_bits = probe.bits, probe.key_bits, probe.value_bits
        self.seed = probe.seed
        # Codecs are a pure function of (head_dim, bits, seed): rebuild them
        # from the recorded head_dim, never guess it from the packed width.
        self.key_codec, self.value_codec = probe.key_codec, probe.value_codec
        pending = mx.array(right, dtype=mx.int32) if right is not None else None
        if keys is not None:
            self._end = end
            self._right_padding = pending
            self._invalidate()
        else:
            self._invalidate()
            if end == 0 and right is not None and len(right) == self.batch_size:
                self._right_padding = pending  # a prefill declared on an empty cache
            self._restoring = (end, right)  # checked and completed by the next state
        self._retype()

    @classmethod
    def from_state(cls, state, meta_state) -> BatchTurboQuantKVCache:
        """Rebuild a cache, codecs included, from ``state`` and ``meta_state``."""
        bits = _validate.meta_state(meta_state)[1]  # every field checked before anything is built
        obj = cls.__new__(cls)
        TurboQuantKVCache.__init__(obj, bits=bits)
        obj.state = state
        obj.meta_state = meta_state
        return obj

    # Prefix-cache snapshots of the parent assume one int offset.
    def prefix_cache_snapshot(self):
        raise NotImplementedError("extract() rows and snapshot the single-request caches")

    def prefix_cache_restore(self, snapshot):
        raise NotImplementedError("restore single-request caches, then merge()")


class BatchableTurboQuantKVCache(TurboQuantKVCache):
    """mlx-vlm's single-request ``TurboQuantKVCache``, plus a ``merge`` into a tqbatch batch.

    mlx-lm's ``BatchGenerator`` batches per-request caches by calling
    ``caches[0][layer].merge(...)`` (``mlx_lm.generate._merge_caches``), as
    ``KVCache.merge`` builds a ``BatchKVCache``. mlx-vlm's class has no
    ``merge``; everything else (quantization, attention) is the parent's,
    run where the work runs: mlx-vlm launches its Metal kernels without a
    stream, which MLX 0.32 sends to the GPU whatever the default device, so
    each step that may launch one runs with mlx-vlm's gate following the
    device (``tqbatch._devices``). Use it as a model's ``make_cache()`` entry
    to run ``BatchGenerator`` on tqbatch; ``BatchTurboQuantKVCache.extract``
    returns it.
    """

    def update_and_fetch(self, keys, values):
        with mlx_vlm_follows_device():
            return super().update_and_fetch(keys, values)

    def dequantize(self, *args, **kwargs):
        with mlx_vlm_follows_device():
            return super().dequantize(*args, **kwargs)

    def decode_attention(self, *args, **kwargs):
        with mlx_vlm_follows_device():
            return super().decode_attention(*args, **kwargs)

    def prefill_attention(self, *args, **kwargs):
        with mlx_vlm_follows_device():
            return super().prefill_attention(*args, **kwargs)

    @classmethod
    def merge(cls, caches) -> BatchTurboQuantKVCache:
        return BatchTurboQuantKVCache.merge(caches)

    def prefix_cache_merge(self, rows, prefix_lens) -> BatchTurboQuantKVCache | None:
        """mlx-vlm's prefix-cache hook: single-row snapshots into a tqbatch batch.

        mlx-vlm's checkpoint prefix cache (``mlx_vlm.apc_adapters.merge_cache_entries``)
        asks each row's cache in turn and takes the first batch returned. Rows
        are TurboQuant singles of this cache's configuration, each holding
        exactly its prefix length, or empty full-precision ``KVCache``s for
        rows with no cached prefix (length 0). Any other rows: ``None``, so
        mlx-vlm asks the next one. Packed rows are merged as they are, never
        re-quantized.
        """
        rows, lengths = list(rows), [int(n) for n in prefix_lens]
        if not rows or len(rows) != len(lengths):
            return None
        for row, n in zip(rows, lengths):
            if isinstance(row, TurboQuantKVCache) and not isinstance(row, BatchTurboQuantKVCache):
                written = int(row.offset) if row.keys is not None else 0
                if _config_of(row) != _config_of(self) or written != n:
                    return None
            elif not (type(row) in FULL_PRECISION_SINGLES and row.keys is None and n == 0):
                return None
        return BatchTurboQuantKVCache._for_config(_config_of(self)).merge(rows)

    @classmethod
    def from_single(cls, cache: TurboQuantKVCache) -> BatchableTurboQuantKVCache:
        """The same cache (same arrays, codecs, offset) as this class."""
        if isinstance(cache, BatchTurboQuantKVCache) or not isinstance(cache, TurboQuantKVCache):
            raise TypeError(
                "from_single expects a single-request TurboQuantKVCache, got "
                f"{type(cache).__name__}"
            )
        out = cls.__new__(cls)
        out.__dict__.update(cache.__dict__)
        return out
