"""Perf workloads: a batch TurboQuant cache beside mlx-lm's ``BatchKVCache``.

One source of truth for what is measured, shared by ``tests/perf``
(pytest-benchmark) and ``tqbatch bench`` (a plain timer, so the command works
where the tests are not installed). A :class:`Workload` builds, for one
geometry, an untimed ``setup`` and a timed ``run`` per op and side:

* ``target``: the implementation under test (default
  ``tqbatch.BatchTurboQuantKVCache``), fed single-request mlx-vlm
  ``TurboQuantKVCache`` members;
* ``baseline``: mlx-lm's ``BatchKVCache`` (float16), fed ``KVCache`` members
  holding the same number of tokens per request.

Every ``run`` ends in ``mx.eval`` of what the op produced, so lazy work is
timed where it is caused. Ops mutate the cache, so ``setup`` builds a fresh
one every round.

The target's packed states are random bit patterns in the exact layout the
codec produces (probed with a one-token quantization), not quantized data:
quantizing 8 x 8 x 4096 vectors at 8 bits takes over a minute on CPU, and
none of the measured ops depends on the packed values (moves copy bits; the
decode step quantizes its new token for real and attends over every slot).

The timers here (``compare``, ``compare_decode``, ``compare_decode_kernel``)
return rows; ``bench_report`` renders them as tables and plots against their
goals.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.testing.target import load_impl

OPS = ("merge", "extend", "filter", "extract", "prepare+finalize", "trim", "decode")
SIDES = ("target", "baseline")


@dataclass(frozen=True)
class Geometry:
    """Shape of one comparison: B rows, H KV heads, head dim D, context tokens, bits."""

    batch: int
    heads: int
    head_dim: int
    context: int
    bits: int
    query_heads: int | None = None  # decode queries; None: one per KV head

    @property
    def q_heads(self) -> int:
        return self.query_heads or self.heads

    @property
    def label(self) -> str:
        heads = (
            f"H{self.heads}" if self.q_heads == self.heads else f"Hq{self.q_heads}-H{self.heads}"
        )
        return f"B{self.batch}-{heads}-D{self.head_dim}-T{self.context}-{self.bits}bit"


@dataclass(frozen=True)
class ParameterSet:
    """A grid of geometries: batch sizes x contexts x bit widths at one heads/head_dim."""

    name: str
    batches: tuple[int, ...]
    heads: int
    head_dim: int
    contexts: tuple[int, ...]
    bits: tuple[int, ...]
    rounds: int
    query_heads: int | None = None  # decode queries; None: one per KV head

    def geometries(self) -> list[Geometry]:
        return [
            Geometry(batch, self.heads, self.head_dim, context, bits, self.query_heads)
            for bits in self.bits
            for batch in self.batches
            for context in self.contexts
        ]


# The geometry. Rounds are few: one decode step at 4096 tokens costs
# about 2 s on a 2-core CPU.
FULL = ParameterSet("full", (8,), 8, 128, (512, 4096), (4, 8), rounds=5)
# The default test run: the geometry at its short context and 4 bits only
# (a few seconds on CPU; the full grid takes minutes).
SMALL = ParameterSet("small", (8,), 8, 128, (512,), (4,), rounds=3)

# A decode step as models take it: 32 query heads over 8 KV heads, D = 128.
DECODE_FULL = ParameterSet(
    "decode-full", (1, 8), 8, 128, (512, 4096, 16384), (4, 8), rounds=5, query_heads=32
)
DECODE_SMALL = ParameterSet("decode-small", (8,), 8, 128, (512,), (4,), rounds=3, query_heads=32)

PERF_ENV = "TQBATCH_PERF"

# A 5 % goal sits inside run-to-run noise at 5 rounds (ratios of 0.8-1.2 were
# seen for identical work), so the decode-overhead pair gets more samples.
OVERHEAD_ROUNDS_FACTOR = 3


def _full_run() -> bool:
    return os.environ.get(PERF_ENV, "").lower() == "full"


def selected_parameter_set() -> ParameterSet:
    """``FULL`` when ``$TQBATCH_PERF`` is ``full`` (the nox ``perf`` session), else ``SMALL``."""
    return FULL if _full_run() else SMALL


def selected_decode_grid() -> ParameterSet:
    """``DECODE_FULL`` when ``$TQBATCH_PERF`` is ``full``, else ``DECODE_SMALL``."""
    return DECODE_FULL if _full_run() else DECODE_SMALL


@dataclass
class Case:
    """One measurable op: ``run(*setup())`` is timed, ``setup()`` is not."""

    op: str
    side: str
    geometry: Geometry
    setup: Callable[[], tuple]
    run: Callable[..., object]

    def pedantic_setup(self):
        """``setup`` in the ``(args, kwargs)`` form ``benchmark.pedantic`` expects."""
        return self.setup(), {}


def eval_cache(cache) -> None:
    """Evaluate every array a cache holds (packed states are trees; ``mx.eval`` walks them)."""
    held = [getattr(cache, name, None) for name in ("keys", "values", "offset", "left_padding")]
    mx.eval([x for x in held if isinstance(x, (mx.array, tuple, list))])


def _detach(tree):
    # MLX slice assignment rebinds the array object it writes to: a cache
    # sharing leaf objects with the pool would write into the pool.
    return tree_map(lambda a: mx.array(a), tree)


def _rows_tokens(tree, row: int, stop: int):
    return tree_map(lambda a: a[row : row + 1, :, :stop], tree)


@dataclass
class Workload:
    """Inputs and cases for one geometry; pools are built once, caches per round."""

    geometry: Geometry
    impl: type = field(default_factory=load_impl)
    seed: int = 0

    # ------------------------------------------------------------ request shapes

    @property
    def lengths(self) -> list[int]:
        """Request lengths from the full context down to about half of it (row 0 unpadded)."""
        g = self.geometry
        return [g.context - i * g.context // (2 * g.batch) for i in range(g.batch)]

    @property
    def right_padding(self) -> list[int]:
        """Right padding for prepare + finalize: up to about half the context, row 0 none."""
        g = self.geometry
        return [i * g.context // (2 * g.batch) for i in range(g.batch)]

    @property
    def kept_rows(self) -> list[int]:
        """Rows kept by the measured filter: the odd ones, so the unpadded row 0 leaves and
        the survivors share dead columns that a compacting filter must drop."""
        return list(range(1, self.geometry.batch, 2))

    @property
    def trimmed(self) -> int:
        return max(1, self.geometry.context // 8)

    # ------------------------------------------------------------ pools

    def _key(self) -> mx.array:
        """The next key of this workload's stream (from ``seed``). Pools are drawn on the
        default device: numpy would spend tens of seconds on B = 32 at 32k tokens."""
        state = self.__dict__.get("_stream")
        if state is None:
            state = mx.random.key(self.seed)
        state, key = mx.random.split(state)
        self.__dict__["_stream"] = state
        return key

    def _normal(self, shape) -> mx.array:
        return mx.random.normal(shape, dtype=mx.float16, key=self._key())

    @cached_property
    def fp_pool(self) -> tuple[mx.array, mx.array]:
        """Float16 keys and values, (B, H, context, D)."""
        g = self.geometry
        shape = (g.batch, g.heads, g.context, g.head_dim)
        keys, values = self._normal(shape), self._normal(shape)
        mx.eval(keys, values)
        return keys, values

    @cached_property
    def codecs(self):
        """(key_codec, value_codec) of a ``TurboQuantKVCache(bits, seed)`` at this head dim."""
        probe = self._probe_cache
        return probe.key_codec, probe.value_codec

    @cached_property
    def _probe_cache(self) -> TurboQuantKVCache:
        g = self.geometry
        probe = TurboQuantKVCache(bits=g.bits, seed=self.seed)
        token = self._normal((1, g.heads, 1, g.head_dim))
        probe.update_and_fetch(token, token)
        mx.eval(probe.keys, probe.values)
        return probe

    def _random_like(self, state):
        """A (B, H, context, ...) state with the probe's tree and dtypes, random content."""
        g = self.geometry

        def fill(leaf):
            shape = (g.batch, g.heads, g.context, *leaf.shape[3:])
            if leaf.dtype == mx.uint32:
                # Every bit pattern: two 16-bit halves (randint draws through floats).
                hi, lo = (
                    mx.random.randint(0, 2**16, shape, dtype=mx.uint32, key=self._key())
                    for _ in range(2)
                )
                return (hi << 16) | lo
            # Norms: positive, near a unit vector's scale times sqrt(D).
            scale = math.sqrt(g.head_dim)
            norms = mx.random.uniform(0.5 * scale, 1.5 * scale, shape, key=self._key())
            return norms.astype(leaf.dtype)

        return tree_map(fill, state)

    @cached_property
    def tq_pool(self):
        """Packed (keys, values) states, (B, H, context, ...), in the codec's exact layout."""
        probe = self._probe_cache
        # The probe's capacity may exceed its one written slot: take that slot's layout.
        keys = self._random_like(tree_map(lambda a: a[:, :, :1], probe.keys))
        values = self._random_like(tree_map(lambda a: a[:, :, :1], probe.values))
        mx.eval(keys, values)
        return keys, values

    @cached_property
    def step_inputs(self) -> tuple[mx.array, mx.array, mx.array]:
        """One decode step's (queries, keys, values), (B, Hq or H, 1, D) float16."""
        g = self.geometry
        shape = (g.batch, g.heads, 1, g.head_dim)
        q = self._normal((g.batch, g.q_heads, 1, g.head_dim))
        k, v = self._normal(shape), self._normal(shape)
        mx.eval(q, k, v)
        return q, k, v

    # ------------------------------------------------------------ members

    def tq_single(self, row: int, length: int) -> TurboQuantKVCache:
        """Request ``row`` as a single ``TurboQuantKVCache`` holding ``length`` tokens."""
        single = TurboQuantKVCache(bits=self.geometry.bits, seed=self.seed)
        single.key_codec, single.value_codec = self.codecs
        keys, values = self.tq_pool
        single.keys = _detach(_rows_tokens(keys, row, length))
        single.values = _detach(_rows_tokens(values, row, length))
        single.offset = length
        mx.eval(single.keys, single.values)
        return single

    def fp_single(self, row: int, length: int) -> KVCache:
        single = KVCache()
        keys, values = self.fp_pool
        single.update_and_fetch(keys[row : row + 1, :, :length], values[row : row + 1, :, :length])
        mx.eval(single.keys, single.values)
        return single

    def singles(self, side: str, lengths: Sequence[int] | None = None, rows=None) -> list:
        lengths = self.lengths if lengths is None else lengths
        rows = range(len(lengths)) if rows is None else rows
        make = self.tq_single if side == "target" else self.fp_single
        return [make(r, lengths[r]) for r in rows]

    def batch_class(self, side: str) -> type:
        return self.impl if side == "target" else BatchKVCache

    def merged(self, side: str, lengths: Sequence[int] | None = None, rows=None):
        cache = self.batch_class(side).merge(self.singles(side, lengths, rows))
        eval_cache(cache)
        return cache

    # ------------------------------------------------------------ cases

    def case(self, op: str, side: str) -> Case:
        """The measurable ``op`` on ``side`` ("target" or "baseline")."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        try:
            build = getattr(self, "_case_" + op.replace("+", "_"))
        except AttributeError:
            raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}") from None
        setup, run = build(side)
        return Case(op, side, self.geometry, setup, run)

    def _case_merge(self, side):
        cls = self.batch_class(side)

        def run(members):
            eval_cache(cls.merge(members))

        return (lambda: (self.singles(side),)), run

    def _case_extend(self, side):
        half = self.geometry.batch // 2
        rows = range(self.geometry.batch)

        def setup():
            # The first half holds the longer requests: the second is padded on extend.
            return self.merged(side, rows=rows[:half]), self.merged(side, rows=rows[half:])

        def run(cache, other):
            cache.extend(other)
            eval_cache(cache)

        return setup, run

    def _case_filter(self, side):
        def run(cache):
            cache.filter(self.kept_rows)
            eval_cache(cache)

        return (lambda: (self.merged(side),)), run

    def _case_extract(self, side):
        last = self.geometry.batch - 1

        def run(cache):
            eval_cache(cache.extract(last))

        return (lambda: (self.merged(side),)), run

    def _case_prepare_finalize(self, side):
        full = [self.geometry.context] * self.geometry.batch

        def run(cache):
            # As after a right-padded prefill: declare the padding, roll it left.
            cache.prepare(right_padding=self.right_padding)
            cache.finalize()
            eval_cache(cache)

        return (lambda: (self.merged(side, lengths=full),)), run

    def _case_trim(self, side):
        def run(cache):
            cache.trim(self.trimmed)
            eval_cache(cache)

        return (lambda: (self.merged(side),)), run

    def _case_decode(self, side):
        scale = self.geometry.head_dim**-0.5

        def run(cache, queries, keys, values):
            # Model order: the mask for the new query is made before the write.
            mask = cache.make_mask(1, return_array=True)
            k, v = cache.update_and_fetch(keys, values)
            out = scaled_dot_product_attention(queries, k, v, cache, scale=scale, mask=mask)
            mx.eval(out)
            eval_cache(cache)

        return (lambda: (self.merged(side), *self.step_inputs)), run

    # ------------------------------------------------------------ batching overhead

    def overhead_cases(self) -> tuple[Case, Case]:
        """A decode step on row 0 alone: the target at B=1 vs the parent class's own work.

        The parent (mlx-vlm's ``TurboQuantKVCache``) gets the model's usual
        single-request call, ``mask=None``; the target does what a batch must
        (mask, then write, then attend), on bit-identical packed data.
        """
        length = self.geometry.context
        scale = self.geometry.head_dim**-0.5
        q, k, v = (a[:1] for a in self.step_inputs)

        def target_setup():
            cache = self.impl.merge([self.tq_single(0, length)])
            eval_cache(cache)
            return cache, q, k, v

        def target_run(cache, queries, keys, values):
            mask = cache.make_mask(1, return_array=True)
            ks, vs = cache.update_and_fetch(keys, values)
            out = scaled_dot_product_attention(queries, ks, vs, cache, scale=scale, mask=mask)
            mx.eval(out)
            eval_cache(cache)

        def parent_run(cache, queries, keys, values):
            ks, vs = cache.update_and_fetch(keys, values)
            out = scaled_dot_product_attention(queries, ks, vs, cache, scale=scale, mask=None)
            mx.eval(out)
            eval_cache(cache)

        parent_setup = lambda: (self.tq_single(0, length), q, k, v)  # noqa: E731
        one_row = dataclasses.replace(self.geometry, batch=1)
        return (
            Case("decode-overhead", "target", one_row, target_setup, target_run),
            Case("decode-overhead", "parent", one_row, parent_setup, parent_run),
        )


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per token slot (all rows, heads, keys and values) of one geometry."""

    geometry: Geometry
    target: float
    float16: float
    minimum: float

    @property
    def vs_float16(self) -> float:
        return self.target / self.float16

    @property
    def vs_minimum(self) -> float:
        return self.target / self.minimum


def minimum_bytes_per_slot(geometry: Geometry) -> float:
    """Theoretical floor per token slot of one row: bits x D / 8 per head and side, plus a
    float16 norm each."""
    per_side = geometry.heads * (geometry.bits * geometry.head_dim / 8 + 2)
    return 2 * per_side


def float16_bytes_per_slot(geometry: Geometry) -> float:
    return 2 * geometry.heads * geometry.head_dim * 2


def memory_report(cache, geometry: Geometry) -> MemoryReport:
    """``cache.nbytes`` per (row x written slot) beside float16 and the theoretical floor."""
    slots = cache.size() * len(cache.offset.tolist())
    return MemoryReport(
        geometry,
        target=cache.nbytes / slots,
        float16=float16_bytes_per_slot(geometry),
        minimum=minimum_bytes_per_slot(geometry),
    )


# ---------------------------------------------------------------- plain timing


def _time_once(case: Case) -> float:
    args = case.setup()
    # Free the last round's caches now, not inside the timed region.
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        case.run(*args)
        return time.perf_counter() - start
    finally:
        gc.enable()


def time_pair(first: Case, second: Case, rounds: int) -> tuple[float, float]:
    """Median wall-clock seconds of two cases over ``rounds`` fresh setups each, alternating.

    Alternating puts both sides under the same machine load, so a ratio is not
    skewed by load that came and went while one side was being timed.
    """
    samples = [(_time_once(first), _time_once(second)) for _ in range(rounds)]
    return tuple(statistics.median(side) for side in zip(*samples))


@dataclass(frozen=True)
class Row:
    """One line of the comparison: target and reference seconds for an op and geometry."""

    op: str
    geometry: Geometry
    target: float
    reference: float
    reference_name: str

    @property
    def ratio(self) -> float:
        return self.target / self.reference


def compare(
    parameters: ParameterSet,
    impl: type | None = None,
    ops: Sequence[str] = OPS,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Time every op on both sides, and the batching overhead, for each geometry."""
    impl = impl or load_impl()
    rows = []
    for geometry in parameters.geometries():
        workload = Workload(geometry, impl=impl)
        # Warm up: codec tables and MLX kernels are built on first use.
        for side in SIDES:
            warm = workload.case("decode", side)
            warm.run(*warm.setup())
        for op in ops:
            if progress:
                progress(f"{op} {geometry.label}")
            target, baseline = (workload.case(op, side) for side in SIDES)
            rows.append(
                Row(op, geometry, *time_pair(target, baseline, parameters.rounds), "BatchKVCache")
            )
        if progress:
            progress(f"decode-overhead {geometry.label}")
        target, parent = workload.overhead_cases()
        rows.append(
            Row(
                "decode-overhead (B=1)",
                geometry,
                *time_pair(target, parent, OVERHEAD_ROUNDS_FACTOR * parameters.rounds),
                "TurboQuantKVCache",
            )
        )
    return rows


def compare_decode(
    grid: ParameterSet, impl: type | None = None, progress: Callable[[str], None] | None = None
) -> list[Row]:
    """Time a decode step (mask, write one token, attend) on both sides for each geometry."""
    impl = impl or load_impl()
    rows = []
    for geometry in grid.geometries():
        workload = Workload(geometry, impl=impl)
        cases = [workload.case("decode", side) for side in SIDES]
        for case in cases:  # warm up: codec tables and MLX kernels are built on first use
            case.run(*case.setup())
        if progress:
            progress(f"decode {geometry.label}")
        rows.append(Row("decode", geometry, *time_pair(*cases, grid.rounds), "BatchKVCache"))
        del workload, cases
        gc.collect()
    return rows


# The fused CUDA decode kernel beside tqbatch's vectorized path and float16:
# B = 1, 8 and 32, 32 query heads over 8 KV heads, D = 128, 1k to 32k tokens.
DECODE_KERNEL = ParameterSet(
    "decode-kernel",
    (1, 8, 32),
    8,
    128,
    (1024, 2048, 4096, 8192, 16384, 32768),
    (4, 8),
    rounds=10,
    query_heads=32,
)
# Small enough for a CPU (where only the vectorized path and float16 run).
DECODE_KERNEL_SMALL = ParameterSet(
    "decode-kernel-small", (8,), 8, 128, (512,), (4,), rounds=3, query_heads=32
)
KERNEL_ENV = "TQBATCH_DECODE_KERNEL"


@dataclass(frozen=True)
class KernelRow:
    """A decode step's seconds on each path, measured in one run, rounds interleaved."""

    geometry: Geometry
    fused: float | None  # None where the kernel cannot run (no CUDA GPU)
    vectorized: float
    float16: float


def _under_mode(case: Case, mode: str) -> Case:
    """``case`` with its timed run under ``TQBATCH_DECODE_KERNEL=mode`` (read at call time)."""

    def run(*args):
        before = os.environ.get(KERNEL_ENV)
        os.environ[KERNEL_ENV] = mode
        try:
            return case.run(*args)
        finally:
            if before is None:
                os.environ.pop(KERNEL_ENV, None)
            else:
                os.environ[KERNEL_ENV] = before

    return dataclasses.replace(case, side=f"{case.side}:{mode}", run=run)


def compare_decode_kernel(
    grid: ParameterSet,
    impl: type | None = None,
    progress: Callable[[str], None] | None = None,
    on_row: Callable[[KernelRow], None] | None = None,
) -> list[KernelRow]:
    """Time a decode step (mask, write, attend) under the fused kernel, the vectorized
    path and float16 ``BatchKVCache`` for each geometry; the fused side only where MLX's
    default device is CUDA. ``on_row`` gets each row as soon as it is measured (a run cut
    short still leaves the rows it finished)."""
    from tqbatch import _cuda_decode

    impl = impl or load_impl()
    fused_ok = _cuda_decode.available()
    rows = []
    for geometry in grid.geometries():
        workload = Workload(geometry, impl=impl)
        target = workload.case("decode", "target")
        cases = [_under_mode(target, "vectorized"), workload.case("decode", "baseline")]
        if fused_ok:
            cases.insert(0, _under_mode(target, "fused"))
        for case in cases:  # warm up: kernels compiled, codec tables built
            case.run(*case.setup())
        if progress:
            progress(f"decode paths {geometry.label}")
        samples = [[_time_once(case) for case in cases] for _ in range(grid.rounds)]
        medians = [statistics.median(side) for side in zip(*samples)]
        fused = medians.pop(0) if fused_ok else None
        rows.append(KernelRow(geometry, fused, *medians))
        if on_row:
            on_row(rows[-1])
        del workload, cases, target
        gc.collect()
    return rows


def copy_bandwidth(megabytes: int = 1024, rounds: int = 10) -> float:
    """Bytes per second a device-to-device copy moves on the default device, counting
    bytes read plus bytes written (median of ``rounds``): the ceiling a decode step's
    reads are held against."""
    n = megabytes * 2**20 // 4
    src = mx.random.uniform(shape=(n,))
    mx.eval(src)
    mx.eval(src + 1)  # warm up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        mx.eval(src + 1)
        times.append(time.perf_counter() - start)
    return 2 * n * 4 / statistics.median(times)
