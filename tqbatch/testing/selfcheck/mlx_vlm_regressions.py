"""Regressions injected into mlx-vlm's batch cache: one method broken each.

A cache owner whose class already has listed failures (mlx-vlm's
``BatchTurboQuantKVCache`` and ``tqbatch/known_failures/mlx_vlm_0_7_10.txt``)
gates CI on the plugin with that list: a new defect must still fail the run,
even where the listed ones end or divert most examples. Each class here
subclasses mlx-vlm's class and breaks one method in a way its list does not
name; ``python scripts/time_plugin_reports.py --mlx-vlm-regressions`` runs
the plugin with the shipped list against each (docs/search-speed.md).

``REGRESSIONS`` maps a name to its class, ``CATCHES`` a name to the check
(``tqbatch.testing.contract.checks``) its defect breaks first. Each class is
importable by path, e.g. ``tqbatch.testing.selfcheck.mlx_vlm_regressions:TrimKeepsOffset``.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_vlm.turboquant import BatchTurboQuantKVCache

from tqbatch.testing.contract.ops import CHECKS

__all__ = ["REGRESSIONS", "CATCHES", "import_path"]

REGRESSIONS: dict[str, type[BatchTurboQuantKVCache]] = {}
CATCHES: dict[str, str] = {}


def _regression(catches: str):
    if catches not in CHECKS:
        raise ValueError(f"{catches!r} is not a check of tqbatch.testing.contract.checks")

    def register(cls):
        REGRESSIONS[cls.__name__] = cls
        CATCHES[cls.__name__] = catches
        return cls

    return register


def import_path(name: str) -> str:
    """``module:Class`` of regression ``name``, for ``--tqbatch-impl``."""
    return f"{__name__}:{REGRESSIONS[name].__name__}"


def _written(cache: BatchTurboQuantKVCache) -> bool:
    return cache.keys is not None


@_regression("default_mask")
class MaskWithoutLeftPadding(BatchTurboQuantKVCache):
    """make_mask() leaves the left padding out: padded rows attend to their padding."""

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, **kwargs)


@_regression("offset")
class TrimKeepsOffset(BatchTurboQuantKVCache):
    """trim() moves the write position back but not the rows' offsets."""

    def trim(self, n):
        n = min(self._idx, n)
        self._idx -= n
        return n


@_regression("offset")
class DecodeKeepsOffset(BatchTurboQuantKVCache):
    """A one-token write (decode) stores the token but leaves the offsets where they were."""

    def update_and_fetch(self, keys, values):
        fetched = super().update_and_fetch(keys, values)
        if keys.shape[2] == 1:
            self.offset = self.offset - 1
        return fetched


@_regression("extract_length")
class ExtractSkipsFirstToken(BatchTurboQuantKVCache):
    """extract() starts one token past the row's left padding: the first token is lost."""

    def extract(self, idx):
        left_padding = self.left_padding
        self.left_padding = left_padding + 1
        try:
            return super().extract(idx)
        finally:
            self.left_padding = left_padding


@_regression("left_padding")
class FilterKeepsCompactedPadding(BatchTurboQuantKVCache):
    """filter() drops the padding columns every kept row shares but not their count from
    the rows' left padding."""

    def filter(self, batch_indices):
        indices = mx.array(batch_indices)
        dropped = min(self.left_padding[indices].min().item(), self._idx)
        super().filter(batch_indices)
        if dropped > 0:
            self.left_padding = self.left_padding + dropped


@_regression("left_padding")
class ExtendKeepsShorterPadding(BatchTurboQuantKVCache):
    """extend() of two written batches pads the shorter one's tokens on the left but does
    not add that padding to its rows' left padding."""

    def extend(self, other):
        both = _written(self) and _written(other)
        left_padding = mx.concatenate([self.left_padding, other.left_padding])
        super().extend(other)
        if both:
            self.left_padding = left_padding


@_regression("offset")
class ExtendOffsetsSwapped(BatchTurboQuantKVCache):
    """extend() of two written batches puts the other batch's offsets first."""

    def extend(self, other):
        both = _written(self) and _written(other)
        mine, theirs = mx.array(self.offset), mx.array(other.offset)
        super().extend(other)
        if both:
            self.offset = mx.concatenate([theirs, mine])
