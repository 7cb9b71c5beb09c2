"""Every family of the model matrix by name: mlx-vlm's, then mlx-lm's (``mlx-lm:`` names)."""

from __future__ import annotations

from tqbatch.workbench import lm_families, vlm_families
from tqbatch.workbench.family import Family

__all__ = ["BY_NAME", "NAMES", "named"]

BY_NAME: dict[str, Family] = {**vlm_families.SPECS, **lm_families.SPECS}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def named(name: str) -> Family:
    """The family called ``name``."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown family {name!r}; expected one of {NAMES}") from None
