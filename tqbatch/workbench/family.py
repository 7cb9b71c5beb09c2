"""One model family of the matrix: its config, how to build it and which caches it holds.

A family is chosen once by name (``families.named``) and asked from then on,
so that no caller re-decides which library serves it. Its two kinds are
``vlm_families.VlmFamily`` (mlx-vlm's language models under mlx-vlm's cache
rule) and ``lm_families.LmFamily`` (mlx-lm's model classes under mlx-lm's).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import ClassVar

import mlx.nn as nn

__all__ = ["Family"]


@dataclass(frozen=True)
class Family:
    """A tiny random-weight model family: what the matrix asks of one, whatever its library."""

    name: str  # the matrix's name for it
    module: str  # where its attention layers look up scaled_dot_product_attention
    notes: str  # what is special about the family's cache handling
    # The keyword arguments of the family's config class (compare=False: a dict
    # does not hash, and the name already tells two families apart).
    config: dict = field(default_factory=dict, compare=False, repr=False)
    # The family's own batched prefill runs each left-padded row alone in a fresh
    # full-precision KVCache and merges afterwards (qwen3_5): its requests alone
    # are then prefilled at full precision and quantized after, as mlx-vlm does
    # with quantized_kv_start, so that alone and batched attend the same prompt.
    prefills_rows_in_full_precision: bool = False
    # Scenarios the family's own code does not support, and why (cells marked N/A).
    not_applicable: tuple[tuple[str, str], ...] = ()

    library: ClassVar[str]  # "mlx-lm" or "mlx-vlm": whose model code it is
    # Scenarios beyond the matrix's shared ones that only this library's models run.
    own_scenarios: ClassVar[tuple[str, ...]] = ()

    def build(self, seed: int = 0) -> nn.Module:
        """The family's model with seeded random float32 weights, evaluated."""
        raise NotImplementedError

    def quantized_layers(self, model: nn.Module) -> list[int]:
        """The layers the library's cache rule puts on TurboQuant."""
        raise NotImplementedError

    def alone_caches(
        self, model: nn.Module, layers: Sequence[int], quantized: bool, bits: float, seed: int
    ) -> list:
        """One request's caches by the library's rule, a ``TurboQuantKVCache`` on ``layers``
        if ``quantized``."""
        raise NotImplementedError

    def batch_caches(
        self, model: nn.Module, left_padding, target_cls: type | None, bits: float, seed: int
    ) -> list:
        """A left-padded batch's caches by the library's rule, ``target_cls`` where it
        quantizes (None: full precision throughout)."""
        raise NotImplementedError

    def routed(self) -> AbstractContextManager:
        """The context the model runs in: where its attention finds TurboQuant caches."""
        return nullcontext()
