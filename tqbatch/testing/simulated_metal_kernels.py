"""Emulations of mlx-vlm's TurboQuant Metal kernels in plain MLX ops (a simulated Mac's "pass")."""

from __future__ import annotations


def find(name: str):
    """The emulation of the kernel named ``name``, or None."""
    return None
