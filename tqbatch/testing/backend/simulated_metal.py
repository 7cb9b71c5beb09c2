"""A pretended Metal on a machine without one.

tqbatch's users run CI on GitHub's hosted macOS arm64 runners, whose GPU is a
paravirtual Metal device: MLX's own ops work there, custom kernels have been
reported to return zeros, and pipeline-state builds occasionally fail. This
module lets a Linux machine (MLX's CPU build) play such a Mac, so tests can
show which lane a run ends in and that the CPU lane launches no Metal kernel.

What is simulated, while a :class:`SimulatedMetal` is installed:

* Metal's presence: ``mx.metal.is_available()``, ``mx.is_available(mx.gpu)``
  and ``mx.device_count(mx.gpu)`` say there is a GPU; ``mx.device_info()``
  (for the GPU) and ``mx.metal.device_info()`` answer with a Mac's keys.
* The default device, as a pretence: ``mx.set_default_device`` remembers the
  device and ``mx.default_device()`` returns it (the GPU at first, as on a
  Mac, unless this process's lane is the CPU).
* ``mx.fast.metal_kernel``: a fake factory whose kernels follow MLX's dispatch
  rule (``rule``: where a launch without a stream runs, and MLX's real error
  where that is not the GPU), record every launch (:attr:`SimulatedMetal.launches`,
  and at once in ``$TQBATCH_SIMULATED_METAL_LOG``), and answer by ``mode``:

  - ``pass``: what Metal would compute, from an emulation of the kernel in
    plain MLX ops (``tqbatch.testing.backend.simulated_metal_kernels``; a kernel with
    no emulation raises ``NotImplementedError`` naming it);
  - ``zeros``: every output all zeros, as reported of paravirtual devices;
  - ``raise``: MLX's Metal backend's error for a pipeline state (or, with
    ``failure="library"``, a library) it could not build;
  - ``flaky``: that error on the process's first launch only, then ``pass``
    (an occasional failed build, which a retry gets past);
  - ``absent``: ``mx.fast`` has no ``metal_kernel`` at all (nothing recorded);
  - ``refuse``: every launch raises ``RuntimeError("simulated Metal refused a
    kernel launch: NAME")``, for a run that must launch none.

What is NOT simulated:

* The GPU itself. Every real op (matmuls, gathers, the emulated kernels) still
  runs on the CPU, with the CPU's rounding; "the GPU is the default device" is
  only what ``mx.default_device()`` says. ``mx.stream(mx.gpu)``,
  ``mx.default_stream(mx.gpu)`` and ``mx.new_stream(mx.gpu)`` still raise, and
  ``with mx.stream(mx.cpu):`` is not seen by the 0.31 rule.
* Unified memory, the working set and buffer limits: ``device_info`` reports a
  working set, nothing enforces it.
* Metal's fast-math rounding (``fast::exp`` and the like): emulations compute
  in float32 with MLX's CPU ops, so they agree with plain MLX ops more closely
  than a real GPU would.
* When errors surface: MLX builds a kernel's pipeline state when the output is
  evaluated; the simulated build error is raised at the launch itself.
* Kernels without an emulation: only the emulated ones "pass".

Activation in a subprocess: ``tests/simulated_mac/sitecustomize.py`` calls
:func:`install_from_environment`, which reads ``$TQBATCH_SIMULATED_METAL``
(``MODE`` or ``MODE:RULE``). Installing never imports mlx: the patches wait
for ``mlx.core`` to be imported (``tqbatch.testing.backend.after_import``), because
the harness must choose the matmul precision before mlx is imported.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass

from tqbatch.testing.backend.after_import import after_import

__all__ = [
    "DEFAULT_DEVICE_NAME",
    "LOG_VARIABLE",
    "MODES",
    "RULES",
    "VARIABLE",
    "Launch",
    "SimulatedMetal",
    "install_from_environment",
    "parse_specification",
    "read_launch_log",
]

MODES = ("pass", "zeros", "raise", "flaky", "absent", "refuse")
RULES = ("0.32", "0.31")
FAILURES = ("pipeline", "library")
VARIABLE = "TQBATCH_SIMULATED_METAL"
LOG_VARIABLE = "TQBATCH_SIMULATED_METAL_LOG"
DEFAULT_DEVICE_NAME = "Apple Paravirtual device (simulated)"
# GitHub's hosted macOS arm64 runners have 7 GB of memory.
DEFAULT_MEMORY = 7 * 2**30
# MLX's Metal backend reports iogpu.rsrc_limit, or this when sysctl has none.
DEFAULT_RESOURCE_LIMIT = 499000

# MLX's own messages (mlx/backend/common/metal_kernel.cpp and
# mlx/backend/metal/device.cpp, MLX 0.31-0.32). std::invalid_argument reaches
# Python as ValueError, std::runtime_error as RuntimeError.
WRONG_DEVICE = "[metal_kernel] Only supports the GPU."
NO_OUTPUTS = "[metal_kernel] Must specify at least one output."
PIPELINE_FAILED = "[metal::Device] Unable to load kernel {kernel}\n{description}\n"
LIBRARY_FAILED = "[metal::Device] Unable to build metal library from source\n{description}\n"
# Metal's error description (NSError.localizedDescription) is the driver's; ours says what it is.
FAILURE_DESCRIPTION = "simulated: the paravirtual device failed to build it"

# MLX's get_type_string, which names a kernel's instantiation.
_TYPE_STRINGS = {
    "float32": "float",
    "float16": "float16_t",
    "bfloat16": "bfloat16_t",
    "float64": "double",
    "complex64": "complex64_t",
    "bool": "bool",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
}
# MLX passes inputs with fewer elements than this in Metal's constant address space.
_MAX_CONSTANT_ARRAY_SIZE = 8

_MISSING = object()
_active_lock = threading.Lock()
_from_environment: SimulatedMetal | None = None


@dataclass(frozen=True)
class Launch:
    """One call of a simulated kernel: its ``name=``, where MLX would run it, what came of it.

    ``device`` is ``gpu`` or ``cpu``; ``outcome`` one of ``emulated``,
    ``zeros``, ``build-failed``, ``refused``, ``wrong-device`` (MLX's own
    error: the launch landed on the CPU), ``not-emulated``, ``invalid``
    (MLX's argument checks failed) or ``uninstalled`` (a kernel kept past
    :meth:`SimulatedMetal.uninstall`).
    """

    kernel: str
    device: str
    outcome: str


class SimulatedMetal:
    """Pretends Metal is present for as long as it is installed; see the module's docstring.

    ``mode``: how kernels answer (:data:`MODES`). ``rule``: which MLX's
    dispatch to follow, ``0.32`` (a launch without a stream runs on the GPU
    whatever the default device) or ``0.31`` (it runs on the default device,
    and the CPU raises). ``failure``: which build error ``raise`` and
    ``flaky`` raise. ``default_device``: ``gpu`` or ``cpu`` to pretend at
    first; ``None`` is a Mac's default, the GPU, unless this process's lane
    (``tqbatch.testing.backend.lane``) is the CPU. ``log``: a file each launch is
    appended to at once, as one JSON line. ``counted``: whether the lane's
    count of launched kernels (``lane.launched()``) includes this simulator's,
    as it would a real Mac's; tests that play a Mac inside another run pass
    False, so that run's report lists only its own launches.

    Use as a context manager, or :meth:`install` and :meth:`uninstall`. One at
    a time per process.
    """

    _active: SimulatedMetal | None = None

    def __init__(
        self,
        mode: str = "pass",
        rule: str = "0.32",
        device_name: str = DEFAULT_DEVICE_NAME,
        working_set: int = 5 * 2**30,
        *,
        architecture: str = "applegpu (simulated)",
        memory_size: int = DEFAULT_MEMORY,
        failure: str = "pipeline",
        default_device: str | None = None,
        log: str | os.PathLike | None = None,
        counted: bool = True,
    ):
        for value, allowed, what in (
            (mode, MODES, "mode"),
            (rule, RULES, "rule"),
            (failure, FAILURES, "failure"),
            (default_device, ("gpu", "cpu", None), "default_device"),
        ):
            if value not in allowed:
                raise ValueError(f"{what} {value!r}: expected one of {allowed}")
        self.mode = mode
        self.rule = rule
        self.failure = failure
        self.device_info = {
            "device_name": device_name,
            "architecture": architecture,
            "max_buffer_length": working_set,
            "max_recommended_working_set_size": working_set,
            "memory_size": memory_size,
            "resource_limit": DEFAULT_RESOURCE_LIMIT,
        }
        self.log = os.fspath(log) if log is not None else None
        self.launches: list[Launch] = []
        self._initial_device = default_device
        self._counted = counted
        self._default_is_gpu = True
        self._installed = False
        self._patched = False
        self._patches: list[tuple[object, str, object]] = []
        self._built: set[str] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SimulatedMetal(mode={self.mode!r}, rule={self.rule!r})"

    # ------------------------------------------------------------- lifetime

    @property
    def installed(self) -> bool:
        """Whether this simulator is installed (its patches wait for mlx if it is not imported)."""
        return self._installed

    def install(self) -> SimulatedMetal:
        """Pretend Metal from now on (from mlx's import, if mlx is not imported yet)."""
        with _active_lock:
            if SimulatedMetal._active is not None:
                raise RuntimeError(f"{SimulatedMetal._active!r} is already installed")
            SimulatedMetal._active = self
            self._installed = True
        after_import("mlx.core", self._patch_mlx)
        after_import("mlx_vlm.turboquant", _forget_mlx_vlm_kernels)
        return self

    def uninstall(self) -> None:
        """Put back every attribute the simulator patched, exactly as it was."""
        with _active_lock:
            if not self._installed:
                return
            self._installed = False
            if SimulatedMetal._active is self:
                SimulatedMetal._active = None
        for owner, attribute, original in reversed(self._patches):
            if original is _MISSING:
                if hasattr(owner, attribute):
                    delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
        self._patches.clear()
        self._patched = False
        turboquant = sys.modules.get("mlx_vlm.turboquant")
        if turboquant is not None:
            _forget_mlx_vlm_kernels(turboquant)

    def __enter__(self) -> SimulatedMetal:
        return self.install()

    def __exit__(self, *exc_info) -> None:
        self.uninstall()

    # ------------------------------------------------------------- patching

    def _patch(self, owner, attribute: str, value) -> None:
        self._patches.append((owner, attribute, getattr(owner, attribute, _MISSING)))
        if value is _MISSING:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, value)

    def _patch_mlx(self, mx) -> None:
        # Registered with after_import, which cannot unregister: a simulator
        # uninstalled before mlx was imported must not patch it afterwards.
        if not self._installed or self._patched:
            return
        self._patched = True
        self._default_is_gpu = self._starts_on_gpu()
        self._pretend_a_gpu(mx)
        self._patch(mx.fast, "metal_kernel", self._factory(mx))

    def _pretend_a_gpu(self, mx) -> None:
        """Metal present, the GPU available, a pretended default device, a Mac's device info."""
        real_is_available = mx.is_available
        real_set_default_device = mx.set_default_device
        real_default_device = mx.default_device
        real_device_info = mx.device_info
        real_device_count = mx.device_count

        def is_available(device):
            return True if _is_gpu(device) else real_is_available(device)

        def device_count(device_type):
            return 1 if _is_gpu(device_type) else real_device_count(device_type)

        def set_default_device(device):
            # This MLX has no GPU backend: the GPU can only be pretended.
            if not _is_gpu(device):
                real_set_default_device(device)
            self._default_is_gpu = _is_gpu(device)

        def default_device():
            if self._default_is_gpu:
                return mx.Device(mx.DeviceType.gpu, 0)
            return real_default_device()

        def device_info(d=None):
            if self._default_is_gpu if d is None else _is_gpu(d):
                return dict(self.device_info)
            return real_device_info() if d is None else real_device_info(d)

        self._patch(mx.metal, "is_available", lambda: True)
        self._patch(mx, "is_available", is_available)
        self._patch(mx, "device_count", device_count)
        self._patch(mx, "set_default_device", set_default_device)
        self._patch(mx, "default_device", default_device)
        self._patch(mx, "device_info", device_info)
        if hasattr(mx.metal, "device_info"):
            self._patch(mx.metal, "device_info", lambda: dict(self.device_info))

    def _starts_on_gpu(self) -> bool:
        if self._initial_device is not None:
            return self._initial_device == "gpu"
        # The lane set MLX's real default device to the CPU before the pretence
        # began (its hook runs first at mlx's import); a Mac would have it too.
        lane = sys.modules.get("tqbatch.testing.backend.lane")
        return not (lane is not None and lane.chosen() == "cpu")

    def _factory(self, mx):
        """The fake ``mx.fast.metal_kernel`` (``_MISSING`` in mode ``absent``)."""
        if self.mode == "absent":
            return _MISSING

        def metal_kernel(
            name,
            input_names,
            output_names,
            source,
            header="",
            ensure_row_contiguous=True,
            atomic_outputs=False,
            compile_options=None,
        ):
            if not output_names:
                raise ValueError(NO_OUTPUTS)
            return SimulatedKernel(self, str(name), list(input_names), list(output_names), source)

        current = getattr(mx.fast, "metal_kernel", None)
        if self._counted and getattr(current, "_tqbatch_counted", False):
            # The lane counts launches by wrapping the factory (tqbatch.testing.backend.lane):
            # where it wrapped the real one first, keep counting through ours.
            return type(current)(metal_kernel)
        return metal_kernel

    # ------------------------------------------------------------- launches

    def _launch(
        self,
        kernel: SimulatedKernel,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template,
        init_value,
        stream,
    ):
        import mlx.core as mx

        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        device = self._device_for(stream)
        if not self._installed:
            self._record(kernel.name, device, "uninstalled")
            raise RuntimeError(
                f"simulated Metal kernel {kernel.name} launched after its simulator was "
                "uninstalled (a kernel cached across the simulator's lifetime)"
            )
        # In MLX's order: the argument checks, then the stream, then the build.
        try:
            kernel.check_sizes(inputs, output_shapes, output_dtypes)
        except ValueError:
            self._record(kernel.name, device, "invalid")
            raise
        if self.mode == "refuse":
            self._record(kernel.name, device, "refused")
            raise RuntimeError(f"simulated Metal refused a kernel launch: {kernel.name}")
        if device != "gpu":
            self._record(kernel.name, device, "wrong-device")
            raise ValueError(WRONG_DEVICE)
        if self.mode == "zeros":
            self._record(kernel.name, device, "zeros")
            return [mx.zeros(tuple(s), dtype=d) for s, d in zip(output_shapes, output_dtypes)]
        if self.mode == "raise" or (self.mode == "flaky" and self._first_build(kernel.name)):
            self._record(kernel.name, device, "build-failed")
            raise RuntimeError(self._build_error(kernel.name, template, inputs, output_dtypes))
        return self._emulate(
            kernel,
            inputs,
            output_shapes,
            output_dtypes,
            grid,
            threadgroup,
            template,
            init_value,
            device,
        )

    def _device_for(self, stream) -> str:
        """Where MLX under ``rule`` would run a kernel launched with ``stream``."""
        if stream is not None:
            return "gpu" if _is_gpu(stream) else "cpu"
        if self.rule == "0.32":
            # 0.32: resolve_metal_kernel_stream takes default_stream(Device::gpu).
            return "gpu"
        # 0.31: to_stream of no stream, the default device's default stream.
        return "gpu" if self._default_is_gpu else "cpu"

    def _first_build(self, name: str) -> bool:
        """Whether this is the process's first build: the one ``flaky`` fails."""
        with self._lock:
            first = not self._built
            self._built.add(name)
        return first

    def _build_error(self, name, template, inputs, output_dtypes) -> str:
        if self.failure == "library":
            return LIBRARY_FAILED.format(description=FAILURE_DESCRIPTION)
        full = _instantiation_name(name, template, inputs, output_dtypes)
        return PIPELINE_FAILED.format(kernel=full, description=FAILURE_DESCRIPTION)

    def _emulate(
        self,
        kernel,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template,
        init_value,
        device,
    ):
        from tqbatch.testing.backend import simulated_metal_kernels

        emulation = simulated_metal_kernels.find(kernel.name)
        if emulation is None:
            self._record(kernel.name, device, "not-emulated")
            raise NotImplementedError(
                f"simulated Metal has no emulation of kernel {kernel.name!r} "
                "(tqbatch.testing.backend.simulated_metal_kernels)"
            )
        self._record(kernel.name, device, "emulated")
        outputs = emulation(
            dict(zip(kernel.input_names, inputs)),
            dict(template or ()),
            tuple(grid),
            tuple(threadgroup),
            [tuple(s) for s in output_shapes],
            list(output_dtypes),
            init_value,
        )
        _check_outputs(kernel.name, outputs, output_shapes, output_dtypes)
        return outputs

    def _record(self, kernel: str, device: str, outcome: str) -> None:
        launch = Launch(kernel, device, outcome)
        with self._lock:
            self.launches.append(launch)
        if self.log:
            _append_line(self.log, {**launch.__dict__, "pid": os.getpid()})


class SimulatedKernel:
    """What the fake ``mx.fast.metal_kernel`` returns: call it as MLX's kernel is called."""

    def __init__(self, simulator: SimulatedMetal, name, input_names, output_names, source):
        self.simulator = simulator
        self.name = name
        self.input_names = input_names
        self.output_names = output_names
        self.source = source

    def __repr__(self) -> str:
        return f"<simulated Metal kernel {self.name}>"

    def __call__(
        self,
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
    ):
        return self.simulator._launch(
            self,
            inputs,
            output_shapes,
            output_dtypes,
            grid,
            threadgroup,
            template,
            init_value,
            stream,
        )

    def check_sizes(self, inputs, output_shapes, output_dtypes) -> None:
        """MLX's argument checks, with its message."""
        for actual, expected, what in (
            (len(inputs), len(self.input_names), "inputs"),
            (len(output_shapes), len(self.output_names), "output_shapes"),
            (len(output_dtypes), len(self.output_names), "output_dtypes"),
        ):
            if actual != expected:
                raise ValueError(
                    f"[metal_kernel] Expected `{what}` to have size {expected} but got "
                    f"size {actual}.\n"
                )


# ------------------------------------------------------------------ helpers


def _is_gpu(device) -> bool:
    """Whether a Device, DeviceType or Stream names the GPU."""
    device = getattr(device, "device", device)  # a Stream's device
    device = getattr(device, "type", device)  # a Device's type
    return getattr(device, "name", None) == "gpu"


def _type_string(dtype) -> str:
    return _TYPE_STRINGS.get(str(dtype).rsplit(".", 1)[-1], str(dtype))


def _instantiation_name(name, template, inputs, output_dtypes) -> str:
    """The name MLX gives a kernel's instantiation (what its build error names)."""
    full = f"custom_kernel_{name}"
    if template:
        values = []
        for _, value in template:
            if isinstance(value, bool):
                values.append(str(int(value)))
            elif isinstance(value, int):
                values.append(str(value))
            else:
                values.append(_type_string(value))
        full += "_" + "_".join(values) + "_"
    for x in inputs:
        full += "_" + _type_string(x.dtype)
        if x.ndim == 0:
            full += "s"
        elif x.size < _MAX_CONSTANT_ARRAY_SIZE:
            full += "c"
    for dtype in output_dtypes:
        full += "_" + _type_string(dtype)
    return full


def _check_outputs(name, outputs, output_shapes, output_dtypes) -> None:
    """An emulation must answer exactly the outputs MLX was asked for."""
    got = [(tuple(o.shape), o.dtype) for o in outputs]
    want = [(tuple(s), d) for s, d in zip(output_shapes, output_dtypes)]
    if got != want:
        raise AssertionError(f"the emulation of {name} returned {got}, asked for {want}")


def _forget_mlx_vlm_kernels(turboquant) -> None:
    # mlx-vlm's kernel builders are lru_cached: one called while Metal was
    # absent caches "no kernel" (None), one called while it was pretended
    # caches a simulated kernel. Either would outlive the pretence it was
    # built under, so the caches are emptied when it begins and ends.
    for value in list(vars(turboquant).values()):
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _append_line(path: str, record: dict) -> None:
    # One write of one line with O_APPEND: lines from concurrent processes
    # (xdist workers, subprocesses) do not interleave, and a process that
    # crashes later has already counted its launches.
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_launch_log(path: str | os.PathLike) -> list[dict]:
    """Every launch a log file holds, in order; ``[]`` if there is no such file."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def parse_specification(text: str) -> tuple[str, str]:
    """``MODE`` or ``MODE:RULE`` (``$TQBATCH_SIMULATED_METAL``) as (mode, rule)."""
    mode, _, rule = text.strip().partition(":")
    rule = rule or "0.32"
    if mode not in MODES or rule not in RULES:
        raise ValueError(
            f"{VARIABLE}={text!r}: expected MODE or MODE:RULE, MODE one of {', '.join(MODES)}, "
            f"RULE one of {', '.join(RULES)}"
        )
    return mode, rule


def install_from_environment() -> SimulatedMetal | None:
    """Install the simulator ``$TQBATCH_SIMULATED_METAL`` asks for; nothing if it is unset.

    Launches go to ``$TQBATCH_SIMULATED_METAL_LOG`` too, if that names a file.
    Idempotent: a second call returns the simulator the first installed.
    """
    global _from_environment
    text = os.environ.get(VARIABLE, "").strip()
    if not text:
        return None
    if _from_environment is not None and _from_environment.installed:
        return _from_environment
    mode, rule = parse_specification(text)
    log = os.environ.get(LOG_VARIABLE) or None
    _from_environment = SimulatedMetal(mode, rule, log=log).install()
    return _from_environment
