"""The op executor: apply ops of docs/ops.md to a target and its oracles, and check them.

A ``World`` holds the cache under test (``target``), the numpy model of what
it should hold (``numpy_model``), mlx-lm's full-precision ``BatchKVCache`` (``dense``)
and what a single-request ``TurboQuantKVCache`` holds per request (``refs``).
``World.apply(op)`` performs one op on all of them, generating K/V and queries
deterministically from the op's seeds (``tqbatch.testing.oracles.generation``), with
the op's own module (``tqbatch.testing.contract.ops``); ``World.check()`` verifies
every invariant (``tqbatch.testing.contract.invariants``). Both raise
``AssertionError`` naming the op and the quantity that diverged, after
running every check of the op: the raised failure carries the others
(``CheckFailure.also``). The state machine (``tqbatch.testing.search.stateful``)
and golden-scenario replay (``tqbatch.testing.replay.replayer``) are both built on
these two calls::

    world = World(impl, bits=4.0, seed=0)
    for op in ops:
        world.apply(op)
        world.check()
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.testing.collector import FailureCollector
from tqbatch.testing.contract import invariants, observation
from tqbatch.testing.contract.checks import CheckFailure, ToleratedDivergence
from tqbatch.testing.contract.ops import OPS, VOCABULARY, Vocabulary
from tqbatch.testing.oracles.generation import POISON
from tqbatch.testing.oracles.numpy_model import NumpyBatchModel
from tqbatch.testing.oracles.reference import TurboReferences, to_numpy
from tqbatch.testing.target import capabilities, load_impl

__all__ = ["UnsupportedOp", "World", "format_ops", "nested_ops"]


class UnsupportedOp(Exception):
    """The target lacks a capability the op needs (see ``tqbatch.testing.target``)."""


def nested_ops(op: dict) -> Iterator[dict]:
    """``op`` and every op nested in it (``expect_error.inner``, ``extend.other``), in order."""
    yield op
    if op.get("op") == "expect_error":
        yield from nested_ops(op["inner"])
    elif op.get("op") == "extend":
        for other in op["other"]:
            yield from nested_ops(other)


def format_ops(ops) -> str:
    """A JSON list of ops, one per line: a runnable sequence to paste into a scenario."""
    return "[\n" + ",\n".join("  " + json.dumps(op) for op in ops) + "\n]"


class World:
    """Target, numpy model and oracles, advanced in lockstep by ops.

    Args:
        impl: the cache class under test (default: ``load_impl()``).
        bits, seed, key_bits, value_bits: TurboQuant configuration of every
            request and batch.
        kv_heads, head_dim: K/V geometry.
        ids: request-id counter (shared with the nested worlds of ``extend``).
        contract_checks: also check structural contract points that are not
            geometry or content: no ``_idx`` attribute on a cache holding
            packed (non-array) keys. mlx-vlm treats any cache with ``_idx`` as
            a dense ``KVCache`` (e.g. ``mlx_vlm.models.lfm2`` speculative
            rollback slices ``cache.keys[row, :, a:b, :]``).
        tolerate: a predicate on ``CheckFailure``s to note instead of raise
            (``FailureCollector``); a survey passes "already reported".

    Attributes after ``apply``: ``ops`` (every op applied, in order, as dicts),
    ``last`` (what the last op returned: e.g. attention outputs, extracted
    tokens), ``capabilities`` (what the target offers), ``tolerated`` (the
    tolerated failures seen so far).
    """

    # The op vocabulary the world executes, with its catalogues (checks, bad
    # inputs): an op that runs another op (``expect_error``) reads it here.
    vocabulary: Vocabulary = VOCABULARY

    def __init__(
        self,
        impl: type | None = None,
        *,
        bits: float = 4.0,
        seed: int = 0,
        key_bits: float | None = None,
        value_bits: float | None = None,
        kv_heads: int = 2,
        head_dim: int = 64,
        ids: Iterator[int] | None = None,
        contract_checks: bool = True,
        tolerate: Callable[[CheckFailure], bool] | None = None,
    ):
        self.impl = impl if impl is not None else load_impl()
        self.capabilities = capabilities(self.impl)
        self.bits, self.seed = float(bits), int(seed)
        self.key_bits, self.value_bits = key_bits, value_bits
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self._ids = ids if ids is not None else itertools.count()
        self.contract_checks = contract_checks
        self.failures = FailureCollector(self.vocabulary.checks, tolerate)
        self.target = None
        self.numpy_model = NumpyBatchModel(kv_heads, head_dim, self._ids)
        self.dense = None  # a DenseReference once a batch exists
        self.refs = TurboReferences(bits, seed, key_bits, value_bits)
        self.ops: list[dict] = []
        self.last: Any = None
        self.op: dict | None = None  # the op being applied (or last applied)

    @property
    def tolerate(self) -> Callable[[CheckFailure], bool] | None:
        return self.failures.tolerate

    @property
    def tolerated(self) -> list[CheckFailure]:
        return self.failures.tolerated

    # ================================================================ public

    def supports(self, op: dict) -> bool:
        """Whether the target offers every capability ``op`` and its nested ops need
        (``needs``; for ``new``: whether its constructor takes the configuration,
        ``impl.CONFIGURATIONS``)."""
        kind = op["op"]
        if kind == "expect_error":
            return self.supports(op["inner"])
        need = self.needs(op)
        if kind == "extend":
            return all(self.capabilities.get(c, False) for c in need) and all(
                self.supports(o) for o in op["other"]
            )
        return all(self.capabilities.get(c, False) for c in need)

    def needs(self, op: dict) -> tuple[str, ...]:
        """The capabilities ``op`` itself needs of the target (nested ops aside)."""
        declared = OPS.get(op["op"])
        if declared is None:  # an unknown op is apply's to refuse
            return ()
        if declared.needs_of is not None:
            return declared.needs_of(self, op)
        return declared.needs

    def apply(self, op: dict):
        """Perform ``op`` on target, model and oracles; returns what the op yields.

        Raises ``UnsupportedOp`` if the target lacks a needed capability,
        ``CheckFailure`` (an ``AssertionError``) if the target misbehaves
        during the op (raises unexpectedly, returns wrong values, or an
        ``expect_error`` op does not raise / changes state), ``ToleratedDivergence``
        if the failure is tolerated but leaves the target diverged. Where
        the op fails a check, the checks of ``check()`` run too before it
        raises, so that the failure carries every check the op fails.
        """
        if op.get("op") not in OPS:
            raise ValueError(f"unknown op {op.get('op')!r}; the vocabulary is in docs/ops.md")
        if not self.supports(op):
            raise UnsupportedOp(f"{self.impl.__name__} cannot run {json.dumps(op)}")
        if self.target is None and op["op"] not in ("merge", "new", "expect_error"):
            raise ValueError(f"{op['op']}: no batch yet; start with a 'merge' or 'new' op")
        declared = OPS[op["op"]]
        if declared.validate is not None:
            declared.validate(self, op)
        self.op = op
        self.ops.append(op)
        try:
            ctx = declared.target(self, op)
        except (AssertionError, ToleratedDivergence):
            raise
        except Exception as exc:
            # Nothing else of the op can be evaluated: the oracles never ran it.
            self.failures.stop("raises", op, f"the target raised {type(exc).__name__}: {exc}")
            raise
        with self.failures.collecting() as found:
            self.last = declared.oracles(self, op, ctx)
            if self.failures.would_stop(found):
                # The caller will not get to check(): its checks run here.
                invariants.check_all(self, op)
        self.failures.settle(found)
        return self.last

    def step(self, op: dict) -> dict[str, np.ndarray]:
        """Apply ``op``, check every invariant, and return what a replay records of the step.

        Raises what ``apply`` and ``check`` raise, and ``ObservationError``
        where reading the target afterwards raises. The observation
        (``tqbatch.testing.contract.observation``): the target's geometry, masks and
        packed bytes, and what the op yielded (``Op.observe``: attention
        outputs, extracted rows, the trim count).
        """
        result = self.apply(op)
        self.check()
        observe = OPS[op["op"]].observe
        try:
            obs = observation.of_target(self.target)
            if observe is not None:
                obs.update(observe(self.target, op, result))
        except Exception as exc:
            raise observation.ObservationError(
                f"reading the target raised {type(exc).__name__}: {exc}"
            ) from exc
        return obs

    def check(self):
        """Every invariant of the current state; ``CheckFailure`` naming the failing quantity.

        Every check runs whatever the others found; then the first failure
        that is not tolerated is raised, carrying the others in ``also``
        (``ToleratedDivergence`` where all are tolerated and one has diverged).
        """
        if self.target is None:
            return
        with self.failures.collecting() as found:
            invariants.check_all(self, self.op)
        self.failures.settle(found)

    def report(self, check: str, op, what: str) -> None:
        """Report that ``check`` failed after ``op`` (``FailureCollector.report``)."""
        self.failures.report(check, op, what)

    def spawn(self) -> World:
        """An empty world with this one's configuration and request-id counter."""
        return World(
            self.impl,
            bits=self.bits,
            seed=self.seed,
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            ids=self._ids,
            contract_checks=self.contract_checks,
            tolerate=self.tolerate,
        )

    # ============================================================ for the ops

    def single(self, seed: int | None = None) -> TurboQuantKVCache:
        """A single-request ``TurboQuantKVCache`` of this configuration (``seed``: another)."""
        return TurboQuantKVCache(
            bits=self.bits,
            seed=self.seed if seed is None else seed,
            key_bits=self.key_bits,
            value_bits=self.value_bits,
        )

    def configuration_needs(self, seed=None) -> tuple[str, ...]:
        """Constructor capabilities a cache of this configuration (``seed``: another) needs."""
        need = ()
        if self.key_bits is not None or self.value_bits is not None:
            need += ("split_bits",)
        if (self.seed if seed is None else seed) != 0:  # no seed parameter: seed 0
            need += ("seed",)
        return need

    def construct(self, left_padding, bits=None, seed=None):
        """``impl(left_padding, ...)`` with this configuration (``bits``, ``seed``: others)."""
        kwargs = dict(bits=self.bits if bits is None else bits)
        if self.capabilities.get("seed", True):  # without it, seed 0 (``supports``)
            kwargs["seed"] = self.seed if seed is None else seed
        if self.key_bits is not None:
            kwargs["key_bits"] = self.key_bits
        if self.value_bits is not None:
            kwargs["value_bits"] = self.value_bits
        return self.impl(list(left_padding), **kwargs)

    def write_oracles(self, keys: np.ndarray, values: np.ndarray) -> list[slice]:
        """Append (B, H, T, D) tokens to the dense oracle, the model and the references;
        returns, per row, the slice of the T new tokens that are request tokens."""
        self.dense.update(keys, values)
        taken = self.numpy_model.write(keys, values)
        self.refs.append_rows(
            [
                (row.request.id, keys[b, :, taken[b]], values[b, :, taken[b]])
                for b, row in enumerate(self.numpy_model.rows)
            ]
        )
        return taken

    def trim_references(self, dropped) -> None:
        """Drop ``dropped[b]`` tokens from the end of row ``b``'s request reference."""
        for row, n in zip(self.numpy_model.rows, dropped):
            self.refs.trim(row.request.id, n)

    def admit_row(self, b: int) -> bool:
        """Let row ``b``'s reference take the target's codes where rounding allows them.

        Called where a check of row ``b`` failed: the target's dequantized
        row is read and ``TurboReferences.admit_rounding`` decides, token by
        token. Returns whether any token was taken.
        """
        if not self.capabilities["dequantize"] or self.target.empty():
            return False
        keys, values = (to_numpy(x) for x in self.target.dequantize())
        for got in (keys, values):
            if got.ndim != 4 or got.shape[0] != self.numpy_model.batch_size:
                return False  # rows cannot be told apart: the ``dequantize`` check reports it
        lp, end = self.numpy_model.rows[b].left_padding, self.numpy_model.end
        rid = self.numpy_model.rows[b].request.id
        return self.refs.admit_rounding_row(rid, keys[b, :, lp:end], values[b, :, lp:end])

    def poison_row_token(self, rows: int, rng: np.random.Generator) -> mx.array:
        """One poisoned (rows, H, 1, D) token: written where no reference may see it."""
        shape = (rows, self.kv_heads, 1, self.head_dim)
        return mx.array((rng.standard_normal(shape) * POISON).astype(np.float32))
