"""The lane a harness run computes on, CPU or GPU, and the custom kernels that ran in it.

A verdict names the device it was reached on, so a run on the CPU must not
send work to the GPU behind its back. Since MLX 0.32 a Metal kernel launched
without a stream runs on the GPU whatever MLX's default device is, and
mlx-vlm launches its TurboQuant kernels that way wherever Metal is present.
tqbatch's own cache follows the device per call (``tqbatch._devices``), but
the harness also runs mlx-vlm's classes: its per-request reference caches,
and mlx-vlm's batch cache as a target. On the CPU lane this module closes
mlx-vlm's Metal gate (``mlx_vlm.turboquant._metal_available``) for the whole
process, so those take mlx-vlm's plain-op fallbacks on the CPU too.

The CPU lane is chosen by ``$TQBATCH_DEVICE=cpu``, honoured as soon as
``tqbatch.testing`` is imported (library use, the pytest plugin and the CLI
then share one lane), or by ``backend.select_device("cpu")`` (``--device
cpu``, ``--tqbatch-device cpu``). Neither imports mlx early: the changes wait
for mlx and mlx-vlm to be imported (``tqbatch.testing.backend.after_import``).

Every custom kernel a process launches is counted here by name
(:func:`launched`): the factories ``mx.fast.metal_kernel`` and
``mx.fast.cuda_kernel`` are wrapped when mlx is imported, so a report says
which kernels really ran, not which could have.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

from tqbatch.testing.backend.after_import import after_import

__all__ = [
    "DEVICE_VARIABLE",
    "choose",
    "chosen",
    "count_kernel_launches",
    "describe",
    "honour_environment",
    "launched",
    "mlx_vlm_kernels_kept_off",
]

DEVICE_VARIABLE = "TQBATCH_DEVICE"
_FACTORIES = ("metal_kernel", "cuda_kernel")

_state = {"lane": None, "kept_off": False}
_launches: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def honour_environment() -> None:
    """Take the lane ``$TQBATCH_DEVICE`` names, if any; count kernel launches from now on."""
    count_kernel_launches()
    lane = os.environ.get(DEVICE_VARIABLE)
    if lane in ("cpu", "gpu"):
        choose(lane)


def choose(lane: str) -> None:
    """Run this process on ``lane`` (``cpu`` or ``gpu``) from now on.

    ``cpu``: MLX's default device becomes the CPU once mlx is imported, and
    mlx-vlm's Metal gate stays closed once mlx-vlm is imported. ``gpu``: the
    gate is mlx-vlm's own again (the device itself is ``select_device``'s).
    """
    if lane not in ("cpu", "gpu"):
        raise ValueError(f"lane {lane!r}: expected 'cpu' or 'gpu'")
    _state["lane"] = lane
    if lane == "cpu":
        _state["kept_off"] = True
        after_import("mlx.core", _default_to_cpu)
        after_import("mlx_vlm.turboquant", _close_gate)
    else:
        _state["kept_off"] = False
        after_import("mlx_vlm.turboquant", _open_gate)


def chosen() -> str | None:
    """The lane chosen in this process, or None where none was (MLX's own default)."""
    return _state["lane"]


def mlx_vlm_kernels_kept_off() -> bool:
    """Whether this process keeps mlx-vlm's Metal kernels off (the CPU lane)."""
    return _state["kept_off"]


def _default_to_cpu(mx) -> None:
    if _state["lane"] == "cpu":
        mx.set_default_device(mx.cpu)


def _closed_gate() -> bool:
    """mlx-vlm's Metal gate on the CPU lane: no kernel, its plain-op fallbacks."""
    return False


def _close_gate(turboquant) -> None:
    if not _state["kept_off"]:
        return  # the GPU lane was chosen before mlx-vlm was imported
    if turboquant._metal_available is not _closed_gate:
        turboquant._tqbatch_metal_available = turboquant._metal_available
        turboquant._metal_available = _closed_gate
        _forget_kernels(turboquant)


def _open_gate(turboquant) -> None:
    original = getattr(turboquant, "_tqbatch_metal_available", None)
    if original is not None and turboquant._metal_available is _closed_gate:
        turboquant._metal_available = original
        _forget_kernels(turboquant)


def _forget_kernels(turboquant) -> None:
    # mlx-vlm's kernel builders are lru_cached and answer "no kernel" while the
    # gate is closed: a builder called on one lane must not decide the other's.
    for value in vars(turboquant).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


# ------------------------------------------------------------------ launches


def count_kernel_launches() -> None:
    """Count every custom kernel launched in this process from now on (:func:`launched`)."""
    after_import("mlx.core", _wrap_factories)


def _wrap_factories(mx) -> None:
    fast = getattr(mx, "fast", None)
    for name in _FACTORIES:
        factory = getattr(fast, name, None)
        if factory is not None and not getattr(factory, "_tqbatch_counted", False):
            setattr(fast, name, _CountedFactory(factory))


class _CountedFactory:
    """``mx.fast.metal_kernel`` (or ``cuda_kernel``) whose kernels count their launches."""

    _tqbatch_counted = True

    def __init__(self, factory):
        self._factory = factory

    def __call__(self, *args, **kwargs):
        name = kwargs.get("name", args[0] if args else "unnamed")
        return _CountedKernel(self._factory(*args, **kwargs), str(name))

    def __getattr__(self, attribute):
        return getattr(self._factory, attribute)


class _CountedKernel:
    def __init__(self, kernel, name: str):
        self._kernel = kernel
        self._name = name

    def __call__(self, *args, **kwargs):
        with _lock:
            _launches[self._name] += 1
        return self._kernel(*args, **kwargs)


def launched() -> dict[str, int]:
    """Custom kernels launched in this process so far: name -> launches."""
    with _lock:
        return dict(sorted(_launches.items()))


def describe() -> dict:
    """What a report records about the lane: its name, mlx-vlm's gate, the kernels launched."""
    if not _metal_present():
        gate = "no Metal here"
    elif mlx_vlm_kernels_kept_off():
        gate = "Metal kernels kept off"
    else:
        gate = "Metal kernels on"
    return {"lane": chosen() or "default", "mlx_vlm_metal": gate, "kernels_launched": launched()}


def _metal_present() -> bool:
    mx = sys.modules.get("mlx.core")
    return mx is not None and hasattr(mx, "metal") and mx.metal.is_available()
