"""The op executor: apply ops of docs/ops.md to a target and its oracles, and check them.

A ``World`` holds the cache under test (``target``), the numpy model of what
it should hold (``model``), mlx-lm's full-precision ``BatchKVCache`` (``dense``)
and what a single-request ``TurboQuantKVCache`` holds per request (``refs``).
``World.apply(op)`` performs one op on all of them, generating K/V and queries
deterministically from the op's seeds; ``World.check()`` verifies every
invariant. Both raise ``AssertionError`` naming the op and the quantity that
diverged, after running every check of the op: the raised failure carries
the others (``CheckFailure.also``). The state machine
(``tqbatch.testing.stateful``) and golden-scenario replay
(``tqbatch.testing.scenario``) are both built on these two calls::

    world = World(impl, bits=4.0, seed=0)
    for op in ops:
        world.apply(op)
        world.check()

Padding must never influence outputs: wherever the harness writes a padding
slot (left padding of a prefill, the tail of a right-padded prefill) it writes
*poison* (K/V scaled by ``POISON``); every comparison is against references
that never saw those tokens.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, QuantizedKVCache
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.testing import observation
from tqbatch.testing.backend import matmul_precision
from tqbatch.testing.checks import POLICY_CASES, CheckFailure, KnownFailure, failure
from tqbatch.testing.impl import OPS_BY_CAPABILITY, capabilities, load_impl
from tqbatch.testing.model import BatchModel, attention, causal_mask
from tqbatch.testing.reference import DenseOracle, TurboReferences, to_numpy
from tqbatch.testing.tolerances import attention_tolerance, content_tolerance, excess_ratios

__all__ = [
    "MASK_CHECKS",
    "POISON",
    "UnsupportedOp",
    "World",
    "format_ops",
]

# Scale of K/V written into padding slots. Large enough that attending to one
# poisoned slot moves an output far past the attention tolerance (see
# tqbatch.testing.tolerances: ~1e-3 at float32), small enough that mlx-vlm's
# float16 norms (max 65504) hold it at head_dim <= 256.
POISON = 16.0

# Dequantized rows vs the per-request reference, and batched attention vs
# exact attention over it: the same packed codes by two routes, so only
# rounding may separate them. The bounds are derived per case from the
# operands and the matmul precision in effect: tqbatch.testing.tolerances.

# (N, window_size) pairs at which make_mask is compared after every op.
MASK_CHECKS = ((1, None), (3, None), (1, 2), (4, 3))


class UnsupportedOp(Exception):
    """The target lacks a capability the op needs (see ``tqbatch.testing.impl``)."""


def format_ops(ops) -> str:
    """A JSON list of ops, one per line: a runnable sequence to paste into a scenario."""
    return "[\n" + ",\n".join("  " + json.dumps(op) for op in ops) + "\n]"


def _ints(x) -> list[int]:
    if isinstance(x, mx.array):
        mx.eval(x)
        x = np.array(x)
    return [int(v) for v in np.asarray(x).reshape(-1).tolist()]


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
            (see ``_report``); a survey passes "already reported".

    Attributes after ``apply``: ``ops`` (every op applied, in order, as dicts),
    ``last`` (what the last op returned: e.g. attention outputs, extracted
    tokens), ``capabilities`` (what the target offers), ``tolerated`` (the
    tolerated failures seen so far).
    """

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
        self.tolerate = tolerate
        self.tolerated: list[CheckFailure] = []
        self.target = None
        self.model = BatchModel(kv_heads, head_dim, self._ids)
        self.dense: DenseOracle | None = None
        self.refs = TurboReferences(bits, seed, key_bits, value_bits)
        self.ops: list[dict] = []
        self.last: Any = None
        self._op: dict | None = None
        # While an op's checks run: the failures found so far, settled (raised
        # or tolerated) once every check of the op has run. None: report at once.
        self._found: list[CheckFailure] | None = None

    # ================================================================ public

    def supports(self, op: dict) -> bool:
        """Whether the target offers every capability ``op`` needs (for ``new``: whether its
        constructor takes the configuration, ``impl.CONFIGURATIONS``)."""
        need = _NEEDS.get(op["op"], ())
        if op["op"] == "new":
            need = self._configuration_needs(op.get("seed"))
        if op["op"] == "expect_error":
            return self.supports(op["inner"])
        if op["op"] == "extend":
            return all(self.capabilities.get(c, False) for c in need) and all(
                self.supports(o) for o in op["other"]
            )
        return all(self.capabilities.get(c, False) for c in need)

    def apply(self, op: dict):
        """Perform ``op`` on target, model and oracles; returns what the op yields.

        Raises ``UnsupportedOp`` if the target lacks a needed capability,
        ``CheckFailure`` (an ``AssertionError``) if the target misbehaves
        during the op (raises unexpectedly, returns wrong values, or an
        ``expect_error`` op does not raise / changes state), ``KnownFailure``
        if the failure is tolerated but leaves the target diverged. Where
        the op fails a check, the checks of ``check()`` run too before it
        raises, so that the failure carries every check the op fails.
        """
        if op.get("op") not in _HANDLERS:
            raise ValueError(f"unknown op {op.get('op')!r}; the vocabulary is in docs/ops.md")
        if not self.supports(op):
            raise UnsupportedOp(f"{self.impl.__name__} cannot run {json.dumps(op)}")
        if self.target is None and op["op"] not in ("merge", "new", "expect_error"):
            raise ValueError(f"{op['op']}: no batch yet; start with a 'merge' or 'new' op")
        self._op = op
        self.ops.append(op)
        if op["op"] == "expect_error":
            self.last = self._expect_error(op)
            return self.last
        target_phase, oracle_phase = _HANDLERS[op["op"]]
        try:
            ctx = target_phase(self, op)
        except (AssertionError, KnownFailure):
            raise
        except Exception as exc:
            # Nothing else of the op can be evaluated: the oracles never ran it.
            self._stop("raises", op, f"the target raised {type(exc).__name__}: {exc}")
            raise
        with self._collecting() as found:
            self.last = oracle_phase(self, op, ctx)
            if self._would_stop(found):
                # The caller will not get to check(): its checks run here.
                self._run_checks(op)
        self._settle(found)
        return self.last

    def step(self, op: dict) -> dict[str, np.ndarray]:
        """Apply ``op``, check every invariant, and return what a replay records of the step.

        Raises what ``apply`` and ``check`` raise, and ``ObservationError``
        where reading the target afterwards raises. The observation
        (``tqbatch.testing.observation``): the target's geometry, masks and
        packed bytes, and what the op yielded (attention outputs, extracted
        rows, the trim count).
        """
        padded = None
        if op.get("op") == "attend" and self.target is not None:
            padded = self.model.padding_slots(int(op["queries"]))
        result = self.apply(op)
        self.check()
        try:
            obs = observation.of_target(self.target)
            if op["op"] != "expect_error":
                obs.update(observation.of_op(self.target, op, padded, result))
        except Exception as exc:
            raise observation.ObservationError(
                f"reading the target raised {type(exc).__name__}: {exc}"
            ) from exc
        return obs

    def check(self):
        """Every invariant of the current state; ``CheckFailure`` naming the failing quantity.

        Every check runs whatever the others found; then the first failure
        that is not tolerated is raised, carrying the others in ``also``
        (``KnownFailure`` where all are tolerated and one has diverged).
        """
        if self.target is None:
            return
        with self._collecting() as found:
            self._run_checks(self._op)
        self._settle(found)

    def _run_checks(self, op):
        """The checks of ``check()``, each reporting into the op's failures."""
        checks = [self._check_geometry, self._check_dense_matches_model]
        checks += [self._check_masks, self._check_rows]
        if self.contract_checks:
            checks.insert(0, self._check_contract)
        for check in checks:
            self._guarded(check, op)

    def _guarded(self, check, op, *args):
        """``check(op, *args)``; where reading the target raises, a ``read`` failure instead."""
        try:
            check(op, *args)
        except (AssertionError, KnownFailure):
            raise
        except Exception as exc:
            # A target that crashes while being read (size(), make_mask,
            # dequantize) is a failed check, reported like any other.
            self._report("read", op, f"reading the target raised {type(exc).__name__}: {exc}")

    def _read(self, op, read: Callable[[], Any]) -> Any:
        """``read()``, or None where it raises (a ``read`` failure)."""
        try:
            return read()
        except Exception as exc:
            self._report("read", op, f"reading the target raised {type(exc).__name__}: {exc}")
            return None

    # ============================================================ generation

    def _kv(self, seed: int, shape, scale: float, padded: np.ndarray | None = None):
        """float32 keys and values (B, H, T, D) from ``seed``; padded (B, T) slots poisoned."""
        rng = np.random.default_rng(seed)
        keys = (rng.standard_normal(shape) * scale).astype(np.float32)
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if padded is not None and padded.any():
            factor = np.where(padded, POISON, 1.0).astype(np.float32)[:, None, :, None]
            keys, values = keys * factor, values * factor
        return keys, values

    def _single(self, seed: int | None = None) -> TurboQuantKVCache:
        return TurboQuantKVCache(
            bits=self.bits,
            seed=self.seed if seed is None else seed,
            key_bits=self.key_bits,
            value_bits=self.value_bits,
        )

    def _configuration_needs(self, seed=None) -> tuple[str, ...]:
        """Constructor capabilities a cache of this configuration (``seed``: another) needs."""
        need = ()
        if self.key_bits is not None or self.value_bits is not None:
            need += ("split_bits",)
        if (self.seed if seed is None else seed) != 0:  # no seed parameter: seed 0
            need += ("seed",)
        return need

    def _construct(self, left_padding, bits=None, seed=None):
        kwargs = dict(bits=self.bits if bits is None else bits)
        if self.capabilities.get("seed", True):  # without it, seed 0 (``supports``)
            kwargs["seed"] = self.seed if seed is None else seed
        if self.key_bits is not None:
            kwargs["key_bits"] = self.key_bits
        if self.value_bits is not None:
            kwargs["value_bits"] = self.value_bits
        return self.impl(list(left_padding), **kwargs)

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

    # ================================================================ ops

    # ---- merge
    def _merge_target(self, op):
        lengths = [int(n) for n in op["lengths"]]
        H, D = self.kv_heads, self.head_dim
        rng = np.random.default_rng(op["kv_seed"])
        scale = op.get("scale", 1.0)
        members = [
            (
                (rng.standard_normal((H, n, D)) * scale).astype(np.float32),
                (rng.standard_normal((H, n, D)) * scale).astype(np.float32),
            )
            for n in lengths
        ]
        seeds = op.get("member_seeds") or [self.seed] * len(lengths)
        full_precision = set(op.get("full_precision") or ())
        if op.get("foreign"):
            # Affine-quantized: not the request's exact K/V, so never a member.
            # Left empty (its group sizes do not divide every head_dim): the
            # type alone must be refused.
            singles = [QuantizedKVCache(group_size=32, bits=4) for _ in lengths]
        else:
            singles = [
                KVCache() if i in full_precision else self._single(s) for i, s in enumerate(seeds)
            ]
        for single, (k, v) in zip(singles, members):
            if k.shape[1] and not op.get("foreign"):
                single.update_and_fetch(mx.array(k[None]), mx.array(v[None]))
        merge = self.impl.merge
        if full_precision and len(full_precision) == len(lengths):
            # No member carries a configuration: re-batch through the running
            # batch's class, as mlx-vlm's qwen3_5 does after running rows alone.
            if self.target is None:
                raise ValueError("merge of only full-precision members needs a batch to re-batch")
            merge = type(self.target).merge
        target = merge(singles)
        return target, members

    def _merge_oracles(self, op, ctx):
        self.target, members = ctx
        requests = [self.model.new_request(k, v) for k, v in members]
        self.model.reset_merged(requests)
        self.dense = DenseOracle.merged(members)
        for req in requests:
            self.refs.new(req.id)
        self.refs.append_rows([(req.id, req.keys, req.values) for req in requests])

    # ---- new
    def _new_target(self, op):
        return self._construct(op["left_padding"], op.get("bits"), op.get("seed"))

    def _new_oracles(self, op, target):
        self.target = target
        self.model.reset_empty(op["left_padding"])
        self.dense = DenseOracle.empty(op["left_padding"])
        for row in self.model.rows:
            self.refs.new(row.request.id)

    # ---- prepare
    def _prepare_target(self, op):
        kwargs = {k: op.get(k) for k in ("left_padding", "right_padding") if op.get(k) is not None}
        self.target.prepare(**kwargs)

    def _prepare_oracles(self, op, _):
        self.model.prepare(op.get("left_padding"), op.get("right_padding"))
        self.dense.prepare(op.get("left_padding"), op.get("right_padding"))

    # ---- update
    def _update_shape(self, op, tokens):
        return (
            op.get("rows", self.model.batch_size),
            op.get("heads", self.kv_heads),
            tokens,
            op.get("head_dim", self.head_dim),
        )

    def _update_target(self, op):
        shape = self._update_shape(op, int(op["tokens"]))
        padded = self.model.padding_slots(shape[2]) if shape[0] == self.model.batch_size else None
        keys, values = self._kv(op["kv_seed"], shape, op.get("scale", 1.0), padded)
        self.target.update_and_fetch(mx.array(keys), mx.array(values))
        return keys, values

    def _write_oracles(self, keys, values):
        self.dense.update(keys, values)
        taken = self.model.write(keys, values)
        self.refs.append_rows(
            [
                (row.request.id, keys[b, :, taken[b]], values[b, :, taken[b]])
                for b, row in enumerate(self.model.rows)
            ]
        )
        return taken

    def _update_oracles(self, op, ctx):
        self._write_oracles(*ctx)

    # ---- attend: a forward step (mask, write N tokens, attend)
    def _attend_target(self, op):
        N, Hq = int(op["queries"]), int(op["q_heads"])
        window = op.get("window_size")
        B, D = self.model.batch_size, self.head_dim
        rng = np.random.default_rng(op["q_seed"])
        queries = rng.standard_normal((B, Hq, N, D)).astype(np.float32)
        padded = self.model.padding_slots(N)
        kv_seed = op.get("kv_seed", op["q_seed"] + 1)
        keys, values = self._kv(kv_seed, (B, self.kv_heads, N, D), op.get("scale", 1.0), padded)
        mask = self.target.make_mask(N, return_array=True, window_size=window)
        ks, vs = self.target.update_and_fetch(mx.array(keys), mx.array(values))
        out = scaled_dot_product_attention(
            mx.array(queries), ks, vs, cache=self.target, scale=D**-0.5, mask=mask
        )
        return queries, keys, values, to_numpy(out)

    def _attend_oracles(self, op, ctx):
        queries, keys, values, out = ctx
        window, D = op.get("window_size"), self.head_dim
        end_before = self.model.end
        taken = self._write_oracles(keys, values)
        for b, row in enumerate(self.model.rows):
            valid = taken[b]
            n_valid = valid.stop - valid.start
            if n_valid == 0:
                continue  # every query of this row is padding: its output is unused
            got = out[b, :, valid]
            rid = row.request.id
            ref_k, ref_v = self.refs.dequantized(rid)
            ref_mask = _single_mask(n_valid, ref_k.shape[1] - n_valid, window)
            # Exact (float64) attention over the codes a request alone holds.
            # The bound is for two float32 routes (twice one route's), so it
            # also covers one route against the exact value.
            q = queries[b][:, valid]
            want = attention(q, ref_k, ref_v, ref_mask[0, 0], D**-0.5)
            tol = attention_tolerance(q, ref_k, ref_v, ref_mask[0, 0], D**-0.5)
            excess = _excess(got, want, tol)
            if excess is not None and self._admit_rounding(b):
                # The row holds another code or norm rounding allows: attend over that.
                ref_k, ref_v = self.refs.dequantized(rid)
                want = attention(q, ref_k, ref_v, ref_mask[0, 0], D**-0.5)
                tol = attention_tolerance(q, ref_k, ref_v, ref_mask[0, 0], D**-0.5)
                excess = _excess(got, want, tol)
            if excess is not None:
                self._report(
                    "attention",
                    op,
                    f"attention of row {b} (request {rid}, {n_valid} valid queries) differs from "
                    f"exact attention over the per-request TurboQuant reference by {excess}",
                )
        return {"attention": out, "end_before": end_before}

    # ---- finalize
    def _finalize_target(self, op):
        self.target.finalize()

    def _finalize_oracles(self, op, _):
        self.dense.finalize()
        dropped = self.model.finalize()
        for row, n in zip(self.model.rows, dropped):
            self.refs.trim(row.request.id, n)

    # ---- filter
    def _filter_target(self, op):
        self.target.filter(list(op["indices"]))

    def _filter_oracles(self, op, _):
        self.dense.filter(op["indices"])
        self.model.filter(op["indices"])

    # ---- extend
    def _extend_target(self, op):
        other = self.spawn()
        for inner in op["other"]:
            other.apply(inner)
        if op.get("foreign"):  # bad input: a rotating window is not a request's history
            self.target.extend(BatchRotatingKVCache(8, [0] * len(other.model.offsets)))
        elif op.get("as_dense"):  # the other batch in full precision: quantized on the way in
            if other.dense.right_padding is not None:
                raise ValueError("extend as_dense: finalize the other batch first")
            self.target.extend(other.dense.copy())
        else:
            self.target.extend(other.target)
        return other

    def _extend_oracles(self, op, other):
        self.dense.extend(other.dense)
        self.model.extend(other.model)
        self.refs.absorb(other.refs)

    # ---- extract
    def _extract_target(self, op):
        return self.target.extract(int(op["index"]))

    def _extract_oracles(self, op, single):
        b = int(op["index"])
        row = self.model.rows[b]
        rid = row.request.id
        pending = self.model.right_padding[b] if self.model.right_padding else 0
        length = max(0, self.model.row_length(b) - pending)
        got_len = 0 if single.keys is None else int(single.offset)
        if got_len != length and pending and got_len == self.model.row_length(b):
            # BatchKVCache's extract: the row's slots to the written end, the
            # pending padding as tokens. A legal choice mid-prefill (tqbatch
            # leaves it out): the extracted cache is held to what it chose.
            self._report(
                "extract_pending",
                op,
                f"extract({b}) holds the {pending} slot(s) of right padding still pending as "
                f"tokens ({got_len} tokens; tqbatch leaves them out: {length})",
            )
            length = got_len
        if got_len != length:
            self._report(
                "extract_length",
                op,
                f"extract({b}) holds {got_len} tokens, request {rid} has {length}",
            )
            return {"length": length}
        out = {"length": length}
        if length:
            want_k, want_v = self.refs.dequantized(rid)
            got_k, got_v = single.dequantize()
            got_k, got_v = to_numpy(got_k[0]), to_numpy(got_v[0])
            for name, got, want in (("keys", got_k, want_k), ("values", got_v, want_v)):
                want = want[:, :length]
                if got.shape != want.shape:
                    self._report(
                        "extract_content",
                        op,
                        f"extract({b}) {name} shape {got.shape}, expected {want.shape}",
                    )
                    continue
                excess = _excess(got, want, content_tolerance(want))
                if excess is not None:
                    taken = self.refs.admit_rounding(rid, name, got, content_tolerance(want))
                    if taken is not None:
                        want = taken[:, :length]
                        excess = _excess(got, want, content_tolerance(want))
                if excess is not None:
                    self._report(
                        "extract_content",
                        op,
                        f"extract({b}) {name} differ from the reference by {excess}",
                    )
            out.update(keys=got_k, values=got_v)
            if pending == 0:
                dk, dv = self.dense.extract(b)
                mk, mv = self.model.tokens(b)
                if not (np.array_equal(dk, mk) and np.array_equal(dv, mv)):
                    self._report(
                        "harness", op, f"BatchKVCache.extract({b}) disagrees with the numpy model"
                    )
            # The extracted cache must be independent: append a poison token to
            # it; check() then shows the batch row did not move.
            rng = np.random.default_rng(b)
            poison = (rng.standard_normal((1, self.kv_heads, 1, self.head_dim)) * POISON).astype(
                np.float32
            )
            single.update_and_fetch(mx.array(poison), mx.array(poison))
            mx.eval(single.keys, single.values)
        return out

    # ---- trim
    def _trim_target(self, op):
        return self.target.trim(int(op["n"]))

    def _trim_oracles(self, op, trimmed):
        dense_n = self.dense.trim(int(op["n"]))
        model_n, dropped = self.model.trim(int(op["n"]))
        if not isinstance(trimmed, (int, np.integer)) or int(trimmed) != model_n:
            self._report(
                "trim_count",
                op,
                f"trim returned {trimmed!r}, expected {model_n} (BatchKVCache: {dense_n})",
            )
        for row, n in zip(self.model.rows, dropped):
            self.refs.trim(row.request.id, n)
        return model_n

    # ---- roundtrip
    def _roundtrip_target(self, op):
        donor = self.target
        state, meta = donor.state, donor.meta_state
        fresh = _from_state(self.impl, state, meta)
        # A restored copy must share no array with its donor: write poison
        # into the donor; check() then compares the fresh copy with the oracles.
        # Trimmed by one first where it can be, so that the first poison token
        # lands in a slot the copy holds (past the end it would be invisible),
        # then a second one, so that an offset shared with the copy moves too.
        # One token per write: the first must fit the buffer the copy may
        # share (a longer write would grow the donor into new arrays).
        if not donor.empty():
            B = self.model.batch_size
            pending = self.model.right_padding is not None  # trim waits for finalize
            if self.capabilities["trim"] and min(self.model.offsets) >= 1 and not pending:
                donor.trim(1)
            rng = np.random.default_rng(12345)
            for _ in range(2):
                poison = rng.standard_normal((B, self.kv_heads, 1, self.head_dim)) * POISON
                poison = mx.array(poison.astype(np.float32))
                donor.update_and_fetch(poison, poison)
        return fresh

    def _roundtrip_oracles(self, op, fresh):
        self.target = fresh
        pending = self.model.right_padding
        if pending is not None and getattr(fresh, "_right_padding", pending) is None:
            # Read where mlx-lm keeps it: a restore without it has dropped the
            # padding still pending, as BatchKVCache's state does (it is not
            # in its state). A legal choice mid-prefill (tqbatch keeps it):
            # the oracles follow, the tail is tokens and finalize rolls nothing.
            self._report(
                "roundtrip_pending",
                op,
                f"the restored cache dropped the right padding still pending {pending} "
                "(tqbatch keeps it)",
            )
            self.model.right_padding = None
            self.dense.cache._right_padding = None

    # ---- expect_error
    def _expect_error(self, op):
        inner, expected = op["inner"], op["error"]
        exc_type = getattr(builtins, expected, None)
        if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
            raise ValueError(f"expect_error: {expected!r} is not a builtin exception type")
        before = self._read_snapshot(op)
        target_phase, _ = _HANDLERS[inner["op"]]
        accepted = False
        with self._collecting() as found:
            try:
                target_phase(self, inner)
            except (CheckFailure, KnownFailure):  # from the nested world of an extend
                raise
            except exc_type:
                pass
            except Exception as exc:
                # Rejected all the same: another policy, reported as such; the
                # snapshot below still holds the cache to "nothing changed".
                self._report(
                    "error_type",
                    op,
                    f"expected {expected}, the target raised {type(exc).__name__}: {exc}",
                )
            else:
                accepted = True
                check = "rejects_by_policy" if op.get("case") in POLICY_CASES else "rejects"
                self._report(check, op, f"expected {expected}, the target accepted the op")
            if not accepted:
                # Rejected: nothing may have changed. (An accepted op changed
                # the cache as ops do: "unchanged" has nothing to hold it to.)
                after = self._read_snapshot(op)
                for key in before:
                    a, b = before[key], after[key]
                    if not _same(a, b):
                        self._report(
                            "unchanged",
                            op,
                            f"the rejected op changed the target's {key}: {a!r} -> {b!r}",
                        )
        self._settle(found)
        return expected

    def _read_snapshot(self, op) -> dict:
        try:
            return self._snapshot()
        except Exception as exc:
            # Nothing more of the op can be compared.
            self._stop("read", op, f"reading the target raised {type(exc).__name__}: {exc}")
            raise

    def _snapshot(self) -> dict:
        if self.target is None:
            return {}
        t = self.target
        pending = getattr(t, "_right_padding", None)  # mlx-lm's name for it
        snap = {
            "offset": _ints(t.offset),
            "left_padding": _ints(t.left_padding),
            "size": _ints(t.size()),
            "masks": [
                to_numpy(t.make_mask(n, return_array=True, window_size=window))
                for n, window in MASK_CHECKS
            ],
            "default masks": [
                repr(m) if not isinstance(m, mx.array) else to_numpy(m).tolist()
                for m in (t.make_mask(n, window_size=window) for n, window in MASK_CHECKS)
            ],
            "pending right padding": None if pending is None else _ints(pending),
            "configuration": tuple(
                getattr(t, name, None) for name in ("bits", "key_bits", "value_bits", "seed")
            ),
            # The codec objects themselves: a rejected op must not swap them,
            # even for codecs of the same head_dim and bits (another seed).
            "codecs": tuple(getattr(t, name, None) for name in ("key_codec", "value_codec")),
        }
        if self.capabilities["dequantize"] and not t.empty() and self.model.end > 0:
            k, v = t.dequantize()
            snap["keys"], snap["values"] = to_numpy(k), to_numpy(v)
        return snap

    # ================================================================ checks

    def _report(self, check: str, op, what: str) -> None:
        """The ``CheckFailure`` of ``check``: kept with the op's failures, or raised now.

        While the op's checks run (``_collecting``) the failure is kept and
        the caller carries on with its next check; the op's failures are
        settled once all have run (``_settle``). Outside, it is settled at once.
        """
        exc = failure(check, op, what)
        if self._found is not None:
            self._found.append(exc)
            return
        self._settle([exc])

    def _stop(self, check: str, op, what: str) -> None:
        """Report a diverging failure after which nothing more of the op can be evaluated.

        Settles the op's failures now, this one last: raises, tolerated or not.
        """
        found = self._found if self._found is not None else []
        found.append(failure(check, op, what))
        self._settle(found)

    @contextlib.contextmanager
    def _collecting(self):
        """Keep the failures reported inside (nested: in the same list); yields the list."""
        outer = self._found
        if outer is None:
            self._found = []
        try:
            yield self._found
        finally:
            self._found = outer

    def _tolerated(self, exc: CheckFailure) -> bool:
        return self.tolerate is not None and self.tolerate(exc)

    def _would_stop(self, found: list[CheckFailure]) -> bool:
        """Whether settling ``found`` would raise: a failure not tolerated, or one diverged."""
        return any(not self._tolerated(f) or f.check.diverged for f in found)

    def _settle(self, found: list[CheckFailure]) -> None:
        """Raise what the op's failures call for; return where all are tolerated and none diverged.

        One failure per identity (the first found: a check may fail on
        several rows or masks). The first that is not tolerated is raised,
        carrying every other one not tolerated (``also``, each its own
        identity, listed in a note); tolerated ones are kept in
        ``tolerated``, and where only they failed and one of them has
        diverged, ``KnownFailure`` ends the run.
        """
        first_of: dict[str, CheckFailure] = {}
        for f in found:
            first_of.setdefault(f.identity, f)
        unique = list(first_of.values())
        raised = [f for f in unique if not self._tolerated(f)]
        self.tolerated.extend(f for f in unique if self._tolerated(f))
        if raised:
            first = raised[0]
            first.also = raised[1:]
            if first.also:
                first.add_note(
                    "also failing after this op:\n"
                    + "\n".join(f"  {f.identity}: {f.what}" for f in first.also)
                )
            raise first
        diverged = [f for f in unique if f.check.diverged]
        if diverged:
            raise KnownFailure(diverged[0])

    def _check_contract(self, op):
        keys = getattr(self.target, "keys", None)
        if hasattr(self.target, "_idx") and not isinstance(keys, mx.array):
            self._report(
                "structure",
                op,
                "the cache has an `_idx` attribute but no dense keys: mlx-vlm's speculative "
                "rollback takes the dense-KVCache path on `_idx`",
            )

    def _check_geometry(self, op):
        t, m, d = self.target, self.model, self.dense
        # Each quantity read on its own: one that cannot be read (a ``read``
        # failure) leaves the others to be compared.
        got = {
            "offset": self._read(op, lambda: _ints(t.offset)),
            "left_padding": self._read(op, lambda: _ints(t.left_padding)),
            "size": self._read(op, t.size),
        }
        size = got["size"]
        if size is not None and not isinstance(size, (int, np.integer)):
            self._report(
                "size_type", op, f"size() returned {type(size).__name__} {size!r}, not an int"
            )
            got["size"] = None
        want = {"offset": m.offsets, "left_padding": m.left_padding, "size": m.size()}
        dense = {"offset": d.offsets, "left_padding": d.left_padding, "size": d.size()}
        for key in want:
            if want[key] != dense[key]:
                self._report(
                    "harness",
                    op,
                    f"the numpy model's {key} {want[key]} != BatchKVCache's {dense[key]}",
                )
            elif got[key] is not None and got[key] != want[key]:
                self._report(
                    key, op, f"{key} is {got[key]}, BatchKVCache and the model have {want[key]}"
                )

    def _check_dense_matches_model(self, op):
        if self.dense.cache.keys is None:
            return
        for b in range(self.model.batch_size):
            if self.model.row_length(b) == 0:
                continue
            dk, dv = self.dense.row_tokens(b)
            mk, mv = self.model.tokens(b)
            if not (np.array_equal(dk, mk) and np.array_equal(dv, mv)):
                self._report("harness", op, f"BatchKVCache row {b} tokens disagree with the model")

    def _check_masks(self, op):
        for n, window in MASK_CHECKS:
            want = self.model.mask(n, window)
            dense = self.dense.mask(n, window)
            if dense.shape != want.shape or not np.array_equal(dense, want):
                self._report(
                    "harness", op, f"BatchKVCache make_mask({n}, window_size={window}) != model's"
                )
            self._guarded(self._check_mask, op, n, window, want)
            self._guarded(self._check_default_mask, op, n, window, want)

    def _check_mask(self, op, n, window, want):
        raw = self.target.make_mask(n, return_array=True, window_size=window)
        if not isinstance(raw, mx.array):
            return self._report(
                "mask_form", op, f"make_mask({n}, return_array=True) returned {raw!r}, not an array"
            )
        got = to_numpy(raw)
        if got.dtype != np.bool_:
            return self._report("mask_form", op, f"make_mask({n}) has dtype {raw.dtype}, not bool")
        if got.shape != want.shape:
            return self._report(
                "mask_shape",
                op,
                f"make_mask({n}, window_size={window}) has shape {got.shape}, "
                f"BatchKVCache's is {want.shape}",
            )
        if not np.array_equal(got, want):
            rows = sorted({int(b) for b in np.argwhere(got != want)[:, 0]})
            self._report(
                "mask_values",
                op,
                f"make_mask({n}, window_size={window}) differs from BatchKVCache's in rows {rows}",
            )

    def _check_default_mask(self, op, n, window, want):
        """``make_mask(n)`` as models call it (``return_array`` left False).

        BatchKVCache returns the array; None (attend everything) or "causal"
        are as good only where they mean the same mask: no row padded, no
        window cutting in.
        """
        default = self.target.make_mask(n, window_size=window)
        if isinstance(default, mx.array):
            got = to_numpy(default)
            if got.shape != want.shape or not np.array_equal(got, want):
                self._report(
                    "default_mask",
                    op,
                    f"make_mask({n}, window_size={window}) differs from BatchKVCache's",
                )
            return
        plain = causal_mask(n, self.model.end, [0] * self.model.batch_size, None)
        if default is None and want.all():
            return
        if isinstance(default, str) and default == "causal" and np.array_equal(want, plain):
            return
        self._report(
            "default_mask",
            op,
            f"make_mask({n}, window_size={window}) returned {default!r} where BatchKVCache's "
            "mask masks padding or a window",
        )

    def _admit_rounding(self, b: int) -> bool:
        """Let row ``b``'s reference take the target's codes where rounding allows them.

        Called where a check of row ``b`` failed: the target's dequantized
        row is read and ``TurboReferences.admit_rounding`` decides, token by
        token. Returns whether any token was taken.
        """
        if not self.capabilities["dequantize"] or self.target.empty():
            return False
        keys, values = (to_numpy(x) for x in self.target.dequantize())
        for got in (keys, values):
            if got.ndim != 4 or got.shape[0] != self.model.batch_size:
                return False  # rows cannot be told apart: the ``dequantize`` check reports it
        lp, end = self.model.rows[b].left_padding, self.model.end
        rid = self.model.rows[b].request.id
        return self.refs.admit_rounding_row(rid, keys[b, :, lp:end], values[b, :, lp:end])

    def _check_rows(self, op):
        if not self.capabilities["dequantize"] or self.model.end == 0:
            return
        rows = [b for b in range(self.model.batch_size) if self.model.row_length(b)]
        if not rows:
            return
        if self.target.empty():
            return self._report("content", op, f"the target is empty but rows {rows} hold tokens")
        keys, values = self.target.dequantize()
        end, B = self.model.end, self.model.batch_size
        arrays = {}
        for name, x in (("keys", keys), ("values", values)):
            is_array = isinstance(x, mx.array)
            if not is_array or x.ndim != 4 or not mx.issubdtype(x.dtype, mx.floating):
                form = f"{x.dtype} {x.shape}" if is_array else type(x).__name__
                self._report(
                    "dequantize", op, f"dequantize() {name} are {form}, not a 4-D float array"
                )
            else:
                arrays[name] = to_numpy(x)
        if len(arrays) < 2:
            return  # content cannot be read out of them
        keys, values = arrays["keys"], arrays["values"]
        evaluable = True
        if keys.shape[2] != end or values.shape[2] != end:
            self._report(
                "written_end",
                op,
                f"dequantize() has {keys.shape[2]} slots, expected the written end {end}",
            )
            evaluable = False
        for name, got in (("keys", keys), ("values", values)):
            # Heads and head_dim are each row's, checked with its content.
            if got.shape[0] != B:
                self._report(
                    "dequantize",
                    op,
                    f"dequantize() {name} have {got.shape[0]} rows (shape {got.shape}), the "
                    f"batch {B}",
                )
                evaluable = False
        if not evaluable:
            return  # rows cannot be told apart in these: content is not evaluated
        for b in rows:
            lp = self.model.rows[b].left_padding
            rid = self.model.rows[b].request.id
            want_k, want_v = self.refs.dequantized(rid)
            for name, got, want in (("keys", keys, want_k), ("values", values, want_v)):
                got = got[b, :, lp:end]
                if want is None or got.shape != want.shape:
                    self._report(
                        "content",
                        op,
                        f"row {b} (request {rid}) {name} have shape (H, T, D) {got.shape}, the "
                        f"reference {None if want is None else want.shape}",
                    )
                    continue
                tol = content_tolerance(want)
                excess = _excess(got, want, tol)
                if excess is not None:
                    taken = self.refs.admit_rounding(rid, name, got, tol)
                    if taken is not None:
                        want, tol = taken, content_tolerance(taken)
                        excess = _excess(got, want, tol)
                if excess is not None:
                    outside = excess_ratios(got, want, tol) > 1.0
                    bad = np.argwhere(outside.any(axis=(0, 2)))[:, 0]
                    self._report(
                        "content",
                        op,
                        f"row {b} (request {rid}) dequantized {name} differ from the per-request "
                        f"TurboQuant reference by {excess} at token(s) {bad.tolist()[:8]}",
                    )


def _same(a, b) -> bool:
    """Equality of snapshot entries: arrays element-wise (NaN equal), lists item by item."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _excess(got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> str | None:
    """None if ``|got - want| <= tol`` everywhere (and got is finite), else what went past."""
    ratios = excess_ratios(got, want, tol)
    if not ratios.size or ratios.max() <= 1.0:
        return None
    worst = np.unravel_index(np.argmax(ratios), ratios.shape)
    diff = abs(float(got[worst]) - float(want[worst]))
    bound = float(np.broadcast_to(tol, ratios.shape)[worst])
    return f"{diff:.3g} (bound {bound:.3g} at {matmul_precision()} precision)"


def _single_mask(n_queries: int, past: int, window) -> np.ndarray:
    """(1, 1, N, past + N) causal mask of a lone, unpadded request."""
    return causal_mask(n_queries, past, [0], window)


def _from_state(cls, state, meta_state):
    """A fresh instance from ``state``/``meta_state``, as a prompt-cache loader builds it."""
    from_state = getattr(cls, "from_state", None)
    if from_state is not None:
        try:
            params = inspect.signature(from_state).parameters
        except (TypeError, ValueError):
            params = {}
        if len(params) >= 2:
            return from_state(state, meta_state)
    obj = cls.__new__(cls)  # mlx-lm's protocol: no __init__, then the setters
    obj.state = state
    obj.meta_state = meta_state
    return obj


_HANDLERS = {
    "merge": (World._merge_target, World._merge_oracles),
    "new": (World._new_target, World._new_oracles),
    "prepare": (World._prepare_target, World._prepare_oracles),
    "update": (World._update_target, World._update_oracles),
    "attend": (World._attend_target, World._attend_oracles),
    "finalize": (World._finalize_target, World._finalize_oracles),
    "filter": (World._filter_target, World._filter_oracles),
    "extend": (World._extend_target, World._extend_oracles),
    "extract": (World._extract_target, World._extract_oracles),
    "trim": (World._trim_target, World._trim_oracles),
    "roundtrip": (World._roundtrip_target, World._roundtrip_oracles),
    "expect_error": (None, None),
}

# Op -> capabilities it needs: the inverse of impl.OPS_BY_CAPABILITY.
_NEEDS: dict[str, tuple[str, ...]] = {}
for _capability, _ops in OPS_BY_CAPABILITY.items():
    for _name in _ops:
        _NEEDS[_name] = (*_NEEDS.get(_name, ()), _capability)
