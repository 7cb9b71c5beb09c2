"""Where a codec step issued now runs: on Metal through mlx-vlm's kernels, or in plain MLX ops.

MLX runs an op on the device of the stream it is issued on: the default
stream, unless the caller passes one (``with mx.stream(mx.cpu):`` changes the
default). Custom kernels are the exception since MLX 0.32: a
``mx.fast.metal_kernel`` launched without a stream runs on the GPU whatever the
default device (0.31 raised ``[metal_kernel] Only supports the GPU`` there), and
mlx-vlm launches its kernels without one wherever ``mx.metal.is_available()``.
So on a Mac whose default device is the CPU, mlx-vlm would send half of every
codec step to the GPU. tqbatch decides per call instead: Metal kernels only
where Metal is present and the work runs on the GPU (:func:`metal_kernels_here`);
elsewhere its own plain-op codec (``tqbatch._codec``), and, for the steps it
leaves to mlx-vlm (codecs it does not serve), mlx-vlm with its Metal gate
closed for the call (:func:`mlx_vlm_follows_device`).
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

__all__ = ["metal_kernels_here", "mlx_vlm_follows_device"]


def metal_kernels_here() -> bool:
    """Whether Metal kernels serve work issued now: Metal present, the default device the GPU."""
    return (
        hasattr(mx, "metal")
        and mx.metal.is_available()
        and mx.default_device().type == mx.DeviceType.gpu
    )


@contextlib.contextmanager
def mlx_vlm_follows_device():
    """Within: mlx-vlm launches no Metal kernel unless the work runs on the GPU.

    Closes ``mlx_vlm.turboquant._metal_available`` (mlx-vlm's one gate, read
    at every call) for the duration when Metal is present but the default
    device is the CPU; elsewhere changes nothing. Not thread-safe: the gate
    is a module attribute, and MLX computes one stream at a time per thread.
    A kernel builder mlx-vlm first calls inside caches "no kernel" for the
    process (its builders are ``lru_cache``d): that step then takes mlx-vlm's
    plain fallback on the GPU too, slower but the same codes.
    """
    if not (hasattr(mx, "metal") and mx.metal.is_available()) or metal_kernels_here():
        yield
        return
    from mlx_vlm import turboquant

    gate = turboquant._metal_available
    turboquant._metal_available = _closed
    try:
        yield
    finally:
        turboquant._metal_available = gate


def _closed() -> bool:
    return False
