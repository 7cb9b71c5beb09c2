"""A catalogue of deliberately broken batch caches: one plausible bug each.

Every class here subclasses ``tqbatch.BatchTurboQuantKVCache`` and overrides
as little as possible to re-introduce exactly one bug: the eight defects the
omlx seed was measured to have, and the historical ones named in the seed's
comments and in omlx / mlx-vlm issues. A harness that is worth running
must *kill* each of them (fail against it); the golden scenarios and the
suite-strength self-test use this catalogue to show that theirs do.

Each class is importable by path, e.g.
``TQBATCH_IMPL=tqbatch.testing.mutants:FilterWithoutCompaction``.
``MUTANTS`` maps a name to its class, ``CATCHES`` a name to the check
(``tqbatch.testing.contract.checks``) that must catch it, ``DESCRIPTIONS`` a name to its
one-line description (the class docstring), ``SEED_DEFECTS`` names the eight
seed ones.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch import _packed
from tqbatch.cache import BatchTurboQuantKVCache, _as_packed
from tqbatch.testing.contract.ops import CHECKS

__all__ = [
    "MUTANTS",
    "CATCHES",
    "DESCRIPTIONS",
    "SEED_DEFECTS",
    "HISTORICAL",
    "describe",
    "import_path",
]

MUTANTS: dict[str, type[BatchTurboQuantKVCache]] = {}
# Mutant name -> the check (tqbatch.testing.contract.checks) that must catch it: the
# self-test counts a mutant as caught only by that check.
CATCHES: dict[str, str] = {}
SEED_DEFECTS: list[str] = []
HISTORICAL: list[str] = []


def _mutant(kind: list[str], catches: str):
    if catches not in CHECKS:
        raise ValueError(f"{catches!r} is not a check of tqbatch.testing.contract.checks")

    def register(cls):
        MUTANTS[cls.__name__] = cls
        CATCHES[cls.__name__] = catches
        kind.append(cls.__name__)
        return cls

    return register


def _seed(catches: str):
    return _mutant(SEED_DEFECTS, catches)


def _historical(catches: str):
    return _mutant(HISTORICAL, catches)


def _float_roll(x: mx.array, shifts: mx.array) -> mx.array:
    """Roll float rows of ``x`` (B, H, T, D) right by ``shifts[b]`` along T."""
    n = x.shape[2]
    source = (mx.arange(n)[None, :] - shifts[:, None]) % n
    return mx.take_along_axis(x, source[:, None, :, None], axis=2)


# --------------------------------------------------------------- seed defects


@_seed("left_padding")
class FilterWithoutCompaction(BatchTurboQuantKVCache):
    """filter() keeps shared left padding instead of compacting it: masks grow wider than
    BatchKVCache's (seed defect 1).
    """

    def filter(self, batch_indices):
        keep = list(batch_indices)
        index = mx.array(keep, dtype=mx.int32)
        if self.keys is not None:
            keys, values = self._written()
            self.keys = _packed.select_rows(keys, index)
            self.values = _packed.select_rows(values, index)
        self.offset = self.offset[index]
        self.left_padding = self.left_padding[index]
        if self._right_padding is not None:
            self._right_padding = self._right_padding[index]
        self._invalidate()


@_seed("content")
class FinalizeRequantizes(BatchTurboQuantKVCache):
    """finalize() dequantizes, rolls the floats and re-quantizes: lossy, rows drift from the
    reference (seed defect 2).
    """

    def finalize(self):
        if self._right_padding is None:
            return
        padding = self._right_padding
        if self.keys is not None:
            keys, values = self.dequantize()
            self.keys = self.key_codec.quantize(_float_roll(keys, padding))
            self.values = self.value_codec.quantize(_float_roll(values, padding))
            mx.eval(self.keys, self.values)
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None
        self._invalidate()


@_seed("raises")
class TrimCrashesAtBatch(BatchTurboQuantKVCache):
    """trim() uses the single-request parent's int-offset arithmetic and crashes at B > 1 (seed
    defect 3, omlx #3767).
    """

    def trim(self, n):
        if self.batch_size > 1:
            return TurboQuantKVCache.trim(self, n)
        return super().trim(n)


@_seed("size_type")
class SizeAsArray(BatchTurboQuantKVCache):
    """size() returns the per-row offsets as an array instead of the written end as an int (seed
    defect 4).
    """

    def size(self):
        return mx.array(self.offset)


@_seed("offset")
class StateDropsGeometry(BatchTurboQuantKVCache):
    """state is only (keys, values): a round trip loses per-row offsets and left padding (seed
    defect 5).
    """

    @property
    def state(self):
        keys, values, _, _ = BatchTurboQuantKVCache.state.fget(self)
        return keys, values

    @state.setter
    def state(self, value):
        keys, values = value
        end = _packed.length(_as_packed(keys)) if keys is not None else 0
        rows = _packed.rows(_as_packed(keys)) if keys is not None else 1
        # Without recorded geometry every row looks unpadded and full.
        BatchTurboQuantKVCache.state.fset(self, (keys, values, [end] * rows, [0] * rows))


@_seed("raises")
class BatchOnePaddingMishandled(BatchTurboQuantKVCache):
    """At B = 1, prepare(left_padding=...) crashes and prepare(right_padding=...) is silently
    dropped, so finalize() attends to padding (seed defect 6).
    """

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if self.batch_size == 1:
            if left_padding is not None:
                # The seed kept B = 1 on the parent's int offset, which has no padding.
                raise TypeError("int offset cannot take per-row left padding")
            right_padding = None
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)


@_seed("content")
class HeadDimFromPackedWidth(BatchTurboQuantKVCache):
    """The meta_state restore infers head_dim from the packed width (D = 80 at 3 bits comes back as
    85) (seed defect 7, omlx #577).
    """

    @property
    def meta_state(self):
        return BatchTurboQuantKVCache.meta_state.fget(self)

    @meta_state.setter
    def meta_state(self, value):
        value = list(value)
        keys = getattr(self, "keys", None)
        if keys is not None:
            for slot, side, bits in ((5, keys, value[3]), (6, self.values, value[4])):
                width = side.indices.shape[-1]
                value[slot] = str(int(width * 32 // float(bits)))
        BatchTurboQuantKVCache.meta_state.fset(self, tuple(value))


@_seed("rejects")
class ExtendAcceptsMixedConfig(BatchTurboQuantKVCache):
    """extend() does not compare (bits, seed): rows of two codecs end up in one batch (seed defect
    8, omlx #2045).
    """

    def _check_same_config(self, other, op):
        if op == "extend":
            return
        super()._check_same_config(other, op)


# --------------------------------------------------------------- historical


@_historical("written_end")
class WriteAtMaxOffset(BatchTurboQuantKVCache):
    """update_and_fetch() writes at max(offset) instead of the written end: lands inside live KV
    when every row is padded (omlx #2172).
    """

    def update_and_fetch(self, keys, values):
        if self.keys is not None or self._end:
            self._end = max(0, max(self.offset.tolist()))
        return super().update_and_fetch(keys, values)


@_historical("offset")
class WriteAtCapacity(BatchTurboQuantKVCache):
    """update_and_fetch() writes at the allocated capacity instead of the written end: a gap opens
    once the buffer has grown (seed comment on _phys_end).
    """

    def update_and_fetch(self, keys, values):
        if self.keys is not None:
            capacity = _packed.length(self.keys)
            self.offset = self.offset + (capacity - self._end)
            self._end = capacity
        return super().update_and_fetch(keys, values)


@_historical("offset")
class StateExposesCapacity(BatchTurboQuantKVCache):
    """state slices to the allocated capacity instead of the written end, exposing unwritten slots
    after growth past 256 (seed comment on state).
    """

    @property
    def state(self):
        if self.keys is None:
            return BatchTurboQuantKVCache.state.fget(self)
        # The allocated slots count as written, so offsets move with them.
        extra = _packed.length(self.keys) - self._end
        return self.keys, self.values, self.offset + extra, mx.array(self.left_padding)

    @state.setter
    def state(self, value):
        BatchTurboQuantKVCache.state.fset(self, value)

    @property
    def meta_state(self):
        meta = list(BatchTurboQuantKVCache.meta_state.fget(self))
        if self.keys is not None:
            meta[0] = str(_packed.length(self.keys))
        return tuple(meta)

    @meta_state.setter
    def meta_state(self, value):
        BatchTurboQuantKVCache.meta_state.fset(self, value)


@_historical("mask_values")
class HandWrittenMaskHidesLeftPadded(BatchTurboQuantKVCache):
    """make_mask() is hand-written assuming each row's tokens start at column 0: hides valid tokens
    of left-padded rows and exposes padding (omlx PR #1547).
    """

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        mask = create_causal_mask(N, offset=self._end, window_size=window_size)
        columns = mx.arange(self._end + N)
        valid = columns[None, :] < (self.offset[:, None] + N)
        return mask[None, None] & valid[:, None, None, :]


@_historical("mask_values")
class MakeMaskBatchWindow(BatchTurboQuantKVCache):
    """make_mask() with window_size drops the per-row left padding, so at B > 1 padded rows attend
    to padding (omlx PR #717).
    """

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        if window_size is None or self.batch_size == 1:
            return super().make_mask(N, return_array=return_array, window_size=window_size)
        mask = create_causal_mask(N, offset=self._end, window_size=window_size)
        return mx.broadcast_to(mask, (self.batch_size, 1, *mask.shape))


@_historical("offset")
class ExtendAlignsOnCapacity(BatchTurboQuantKVCache):
    """extend() right-aligns both sides on their allocated capacity instead of their written end,
    burying the shorter side's rows (seed comment on extend).
    """

    def extend(self, other):
        for side in (self, other):
            if isinstance(side, BatchTurboQuantKVCache) and side.keys is not None:
                grown = _packed.length(side.keys) - side._end
                # The unwritten tail is taken for written slots.
                side.offset = side.offset + grown
                side._end = _packed.length(side.keys)
        super().extend(other)


@_historical("size")
class RestoreLeavesEndStale(BatchTurboQuantKVCache):
    """Restoring state/meta_state keeps the instance's previous written end instead of the restored
    one (seed comment on state.setter).
    """

    @property
    def state(self):
        return BatchTurboQuantKVCache.state.fget(self)

    @state.setter
    def state(self, value):
        stale = getattr(self, "_end", 0)
        BatchTurboQuantKVCache.state.fset(self, value)
        self._end = stale

    @property
    def meta_state(self):
        return BatchTurboQuantKVCache.meta_state.fget(self)

    @meta_state.setter
    def meta_state(self, value):
        value = list(value)
        keys = getattr(self, "keys", None)
        value[0] = str(_packed.length(keys) if keys is not None else 0)  # pass the setter's check
        stale = self._end
        BatchTurboQuantKVCache.meta_state.fset(self, tuple(value))
        self._end = stale


@_historical("left_padding")
class FilterKeepsOneDeadColumn(BatchTurboQuantKVCache):
    """filter() compacts one column short: after a filter the mask is one column wider than
    BatchKVCache's (omlx #2237).
    """

    def filter(self, batch_indices):
        keep = list(batch_indices)
        index = mx.array(keep, dtype=mx.int32)
        shared = min(self.left_padding[index].tolist())
        if shared == 0 or self.keys is None:
            return super().filter(batch_indices)
        # Compact all but one dead column: filter, then put one padding column back.
        super().filter(batch_indices)
        keys, values = self._written()
        self.keys, self.values = _packed.pad_left(keys, 1), _packed.pad_left(values, 1)
        self.left_padding = self.left_padding + 1
        self._end += 1
        self._invalidate()


@_historical("structure")
class HasIdxAttribute(BatchTurboQuantKVCache):
    """The written end is stored as `_idx`, which makes mlx-vlm's rollback_speculative_cache take
    the dense-cache path (seed comment on _phys_end).
    """

    @property
    def _idx(self):
        return self._end


@_historical("extract_length")
class ExtractDropsLastToken(BatchTurboQuantKVCache):
    """extract() slices one slot short (stop = end - 1): the extracted request loses its newest
    token.
    """

    def extract(self, idx):
        single = super().extract(idx)
        if single.keys is not None and single.offset > 0:
            n = single.offset - 1
            single.keys = _packed.token_range(single.keys, 0, n)
            single.values = _packed.token_range(single.values, 0, n)
            single.offset = n
        return single


@_historical("offset")
class FilterForgetsRightPadding(BatchTurboQuantKVCache):
    """filter() drops pending right padding, so the following finalize() does not roll and rows
    attend to padding.
    """

    def filter(self, batch_indices):
        super().filter(batch_indices)
        self._right_padding = None


@_historical("offset")
class MergeDropsFullPrecisionMembers(BatchTurboQuantKVCache):
    """merge treats full-precision KVCache members as empty rows, as mlx-vlm's
    prefix_cache_merge does for any row that is not TurboQuant: their tokens are lost."""

    @classmethod
    def merge(cls, caches):
        caches = list(caches)
        configs = [c for c in caches if isinstance(c, TurboQuantKVCache)]
        config = (
            (configs[0].bits, configs[0].key_bits, configs[0].value_bits, configs[0].seed)
            if configs
            else cls._configuration
        )
        if config is None:
            return super().merge(caches)
        bits, key_bits, value_bits, seed = config
        return super().merge(
            [
                c
                if isinstance(c, TurboQuantKVCache)
                else TurboQuantKVCache(
                    bits=bits, seed=seed, key_bits=key_bits, value_bits=value_bits
                )
                for c in caches
            ]
        )


@_historical("unchanged")
class ExtendSwapsCodecsBeforeChecking(BatchTurboQuantKVCache):
    """extend takes the other batch's codecs before checking that the configurations
    match: a rejected mixed-seed extend leaves the batch quantizing with the other seed."""

    def extend(self, other):
        if isinstance(other, BatchTurboQuantKVCache) and other.key_codec is not None:
            self.key_codec, self.value_codec = other.key_codec, other.value_codec
        super().extend(other)


@_historical("unchanged")
class PrepareHalfApplies(BatchTurboQuantKVCache):
    """prepare records the right padding before it checks the left padding: a rejected
    prepare leaves right padding pending, and the next finalize rolls the rows."""

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding, dtype=mx.int32)
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)


@_historical("default_mask")
class DefaultMaskIsNoneAtDecode(BatchTurboQuantKVCache):
    """make_mask(1) with return_array left False returns None, as a single-request
    cache may at decode: with padded rows, models then attend the padding."""

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        if N == 1 and not return_array:
            return None
        return super().make_mask(N, return_array=return_array, window_size=window_size)


@_historical("content")
class RoundtripAliasesDonor(BatchTurboQuantKVCache):
    """state hands out the live buffers when they are exactly full (as mlx-lm's
    KVCache.state does) and the setter keeps the objects it is given: a restored
    copy shares arrays with its donor, and the donor's next in-place write lands in it."""

    @property
    def state(self):
        if self.keys is not None and _packed.length(self.keys) == self._end:
            return self.keys, self.values, mx.array(self.offset), mx.array(self.left_padding)
        return super().state

    @state.setter
    def state(self, value):
        BatchTurboQuantKVCache.state.fset(self, value)
        keys, values = value[0], value[1]
        if keys is not None and _packed.length(keys) == self._end:
            self.keys, self.values = keys, values  # the donor's objects, not copies


@_historical("offset")
class MergeDropsEmptyMembers(BatchTurboQuantKVCache):
    """merge skips empty members (a request with no tokens yet): the batch has fewer
    rows than the caller passed, and every row after the first empty one is misplaced."""

    @classmethod
    def merge(cls, caches):
        caches = list(caches)
        kept = [c for c in caches if getattr(c, "keys", None) is not None] or caches[:1]
        return super().merge(kept)


@_historical("extract_length")
class ExtractIgnoresLeftPadding(BatchTurboQuantKVCache):
    """extract(i) reads the row from slot 0 instead of from its left padding: a
    padded row comes out with padding in front and its newest tokens cut off."""

    def extract(self, idx):
        lp = self.left_padding
        self.left_padding = mx.zeros_like(lp)
        try:
            return super().extract(idx)
        finally:
            self.left_padding = lp


@_historical("offset")
class FinalizeForgetsPaddingAfterWrite(BatchTurboQuantKVCache):
    """finalize() rolls right padding only when a write followed prepare(): a ragged
    speculative rollback (prepare after the verify block, then finalize, as mlx-vlm commits
    one) leaves each row's rejected drafts attended: phantom keys (mlx-vlm #1962).
    """

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        self._prepared_at = self._end

    def finalize(self):
        if self._right_padding is not None and getattr(self, "_prepared_at", None) == self._end:
            self._right_padding = None  # "nothing written since prepare: nothing to roll"
            return
        super().finalize()


# ---------------------------------------------------------------- lookups

DESCRIPTIONS: dict[str, str] = {
    name: " ".join(cls.__doc__.split()) for name, cls in MUTANTS.items()
}


def describe(name: str) -> str:
    """The one-line description of mutant ``name`` (the bug and where it happened)."""
    return DESCRIPTIONS[name]


def import_path(name: str) -> str:
    """``module:Class`` path of mutant ``name``, as TQBATCH_IMPL takes it."""
    return f"{__name__}:{MUTANTS[name].__name__}"
