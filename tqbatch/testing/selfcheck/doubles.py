"""Caches that differ from tqbatch's where they may, for the harness's own tests.

A correct quantizer may store another code where a rotated coordinate sits
within float rounding of a codebook midpoint, or another float16 norm next to
a rounding boundary (``tqbatch.testing.oracles.rounding``): another summation order,
kernel or GPU does. These caches compute their codes from inputs nudged by a
fixed relative amount, so the harness's oracles can be shown to pass such a
cache (nudged within rounding) and to fail one nudged past it.

``PendingPaddingAsBatchKVCache`` treats right padding still pending (between
``prepare`` and ``finalize``) as mlx-lm's ``BatchKVCache`` does, where
tqbatch's policy differs: the harness must pass it on the contract and list
the differences as policy.

``WithoutSplitBits`` and ``WithoutSeed`` are correct caches whose
constructors take fewer configurations (no ``key_bits``/``value_bits``; no
``seed``): the harness must report those configurations as unsupported and
not draw them, never fail the cache for them.

Importable by path like the mutants, e.g. ``tqbatch.testing.selfcheck.doubles:RoundsOtherwise``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tqbatch.cache import BatchTurboQuantKVCache

__all__ = [
    "PendingPaddingAsBatchKVCache",
    "RoundsFarOtherwise",
    "RoundsOtherwise",
    "WithoutSeed",
    "WithoutSplitBits",
]


class RoundsOtherwise(BatchTurboQuantKVCache):
    """Correct, but computes its codes from inputs nudged by 1e-5 relative.

    Rotated coordinates move by ~1e-6 (band: 7.7e-6 at D=64), as another
    summation order would move them: where one lies that close to a midpoint
    the code differs from the reference's, and a float16 norm next to a
    rounding boundary rounds the other way.
    """

    nudge = 1e-5

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(self._nudged(keys), self._nudged(values))

    def _nudged(self, x):
        # Signs fixed by the input's size: the same nudge on every run.
        signs = mx.array(np.random.default_rng(x.size).choice([-1.0, 1.0], x.shape), x.dtype)
        return x * (1 + self.nudge * signs)


class RoundsFarOtherwise(RoundsOtherwise):
    """Inputs nudged by 1e-3: codes move where no rounding could move them (a bug)."""

    nudge = 1e-3


class PendingPaddingAsBatchKVCache(BatchTurboQuantKVCache):
    """Correct, but pending right padding is BatchKVCache's: ``extract`` returns it as tokens
    and ``state``/``meta_state`` do not carry it (a restore has none pending)."""

    def extract(self, idx):
        # BatchKVCache.extract slices the row from its left padding to the written end.
        pending, self._right_padding = self._right_padding, None
        try:
            return super().extract(idx)
        finally:
            self._right_padding = pending

    @property
    def meta_state(self):
        # The last field is tqbatch's pending right padding: left empty.
        return (*BatchTurboQuantKVCache.meta_state.fget(self)[:-1], "")

    @meta_state.setter
    def meta_state(self, value):
        BatchTurboQuantKVCache.meta_state.fset(self, value)


class _NarrowConstructor(BatchTurboQuantKVCache):
    """A constructor that takes fewer keywords than tqbatch's; everything else is tqbatch's.

    Built, an instance is tqbatch's configured class (``_for_config``), whose
    own methods (``merge``, ``extend`` of a full-precision batch) construct
    caches with every keyword: only the constructor the harness calls is
    narrower, which is what these doubles are for.
    """

    @classmethod
    def _for_config(cls, config: tuple) -> type:
        return BatchTurboQuantKVCache._for_config(config)

    @classmethod
    def merge(cls, caches) -> BatchTurboQuantKVCache:
        return BatchTurboQuantKVCache.merge(caches)


class WithoutSplitBits(_NarrowConstructor):
    """Correct, but its constructor has no ``key_bits``/``value_bits``: one width for both."""

    def __init__(self, left_padding, bits=4.0, seed=0):
        super().__init__(left_padding, bits, seed)


class WithoutSeed(_NarrowConstructor):
    """Correct, but its constructor has no ``seed``: it quantizes with seed 0."""

    def __init__(self, left_padding, bits=4.0, *, key_bits=None, value_bits=None):
        super().__init__(left_padding, bits, key_bits=key_bits, value_bits=value_bits)
