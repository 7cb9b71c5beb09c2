"""The cache oracle: batch caches checked against per-request references fed the same K/V.

A batched forward is not bit-equal to the same request run alone (other
matmul shapes, other summation orders), so the K/V a batch cache is handed
differ from the alone-run's in the last float bits, and a value on a
TurboQuant codebook boundary can take another 4-bit code. Comparing logits
with the request run alone therefore mixes forward noise with cache bugs.
This oracle isolates the cache instead. During every forward it captures

* the ``keys, values`` each quantized layer's cache is handed
  (``tqbatch.workbench.kv_ledger.KVLedger``, the model matrix's capture too:
  ``update_and_fetch`` wrapped on the cache's class, recorded per object),
* the queries and output of every attention call of those layers
  (``kv_ledger.AttentionLog``: a spy on the model module's
  ``scaled_dot_product_attention``, matched to a layer by the identity of its
  ``cache`` argument),

and feeds each row's *real* input columns, as the server laid them out
(``tqbatch.workbench.serving.ForwardLayout``, never the cache's own idea of its
padding), to a single-request ``mlx_vlm.turboquant.TurboQuantKVCache`` per
request and layer (``tqbatch.testing.reference.TurboReferences``): exactly
those float values, so reference and batch row must hold the same codes, or
where float rounding lets a correct quantizer choose another code or float16
norm (a coordinate on a codebook midpoint, seen on a GPU), the reference
takes the cache's choice (``tqbatch.testing.rounding``) and later checks
compare with it. Then it checks, with the rounding bounds of
``tqbatch.testing.tolerances``:

* attention: row ``b``'s output on its real query columns against mlx-vlm's
  ``scaled_dot_product_attention`` over the reference's dequantized tokens
  with a causal mask (``tqbatch.workbench.reference_attention``);
* content: whenever the server says the rows are settled, each row's
  dequantized slots ``[left_padding[b], size())`` against the reference's;
* extract: each extracted single-request cache holds as many tokens as the
  reference and the same dequantized content.

Rollbacks trim the references as the server trims its batch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tqbatch.testing.reference import TurboReferences, to_numpy
from tqbatch.testing.tolerances import content_tolerance, excess_ratios
from tqbatch.workbench.cache_rows import read_row, read_rows, read_single
from tqbatch.workbench.kv_ledger import AttentionLog, KVLedger
from tqbatch.workbench.reference_attention import attention_operands, reference_attention
from tqbatch.workbench.serving import ForwardLayout, ServerObserver

__all__ = [
    "CacheCheckFailed",
    "CacheOracle",
    "OracleFailure",
    "RequestChecks",
    "attention_module_of",
]


@dataclass(frozen=True)
class OracleFailure:
    """One check a cache failed.

    ``kind``: "content", "attention", "extract", or "capture" (a layer's
    cache was not handed its K/V exactly once, or attention never ran on it).
    """

    kind: str
    uid: str | None
    layer: int | None
    where: str
    detail: str

    def sentence(self) -> str:
        who = f"request {self.uid}" if self.uid is not None else "the batch"
        layer = f", layer {self.layer}" if self.layer is not None else ""
        return f"{self.kind}: {who}{layer}, {self.where}: {self.detail}"


@dataclass
class RequestChecks:
    """How many checks one request passed through, and the worst |got - want| / tolerance."""

    content: int = 0
    attention: int = 0
    extract: int = 0
    worst_content: float = 0.0
    worst_attention: float = 0.0
    worst_extract: float = 0.0

    def add(self, kind: str, ratio: float):
        setattr(self, kind, getattr(self, kind) + 1)
        worst = f"worst_{kind}"
        setattr(self, worst, max(getattr(self, worst), ratio))


def attention_module_of(model):
    """The module whose ``scaled_dot_product_attention`` the model's attention calls.

    mlx-vlm language models import it by name into their own module (e.g.
    ``mlx_vlm.models.qwen2.language``), which is where a spy must go.
    """
    module = sys.modules[type(model).__module__]
    if not hasattr(module, "scaled_dot_product_attention"):
        raise ValueError(f"{module.__name__} has no scaled_dot_product_attention to spy on")
    return module


@dataclass
class _AttentionCheck:
    uid: str
    layer: int
    row: int  # the request's row in the cache that served the call
    queries: mx.array  # (1, Hq, N, D): the row's real query columns
    got: mx.array  # (Hq, N, D): the batch's output there
    scale: float
    want: mx.array | None = None  # (Hq, N, D): attention over the reference
    mask: np.ndarray | None = None  # (N, T)


class CacheCheckFailed(Exception):
    """Raised from an observer hook to end the run at the first failed check."""


class CacheOracle(ServerObserver):
    """Follows a ``ContinuousBatcher`` (as its observer) and checks its quantized layers.

    Args:
        model: the language model; its module's attention function is spied on.
        bits, seed: TurboQuant configuration of the references (the server's).
        quantized_layers: the layers holding the cache under test; the dense
            ones are full precision and not checked.
        stop_at_first_failure: raise ``CacheCheckFailed`` from the hook that
            found the first failure (a mutant needs no more than one).

    After the run: ``failures`` (every failed check, in order), ``checks``
    (per request uid), ``forwards`` (forwards observed).
    """

    def __init__(
        self,
        model,
        *,
        bits: float,
        seed: int,
        quantized_layers: Sequence[int],
        stop_at_first_failure: bool = False,
    ):
        self.stop_at_first_failure = stop_at_first_failure
        self.module = attention_module_of(model)
        self.bits, self.seed = bits, seed
        self.layers = tuple(quantized_layers)
        # Per layer, every request's reference (a TurboQuantKVCache's tokens).
        self.references = {layer: TurboReferences(bits=bits, seed=seed) for layer in self.layers}
        self.checks: dict[str, RequestChecks] = {}
        self.failures: list[OracleFailure] = []
        self.forwards = 0

    # ------------------------------------------------------------ observer hooks

    @contextmanager
    def forward(self, layout: ForwardLayout, caches: list) -> Iterator[None]:
        self.forwards += 1
        where = f"forward {self.forwards} ({layout.kind})"
        layer_caches = {i: caches[i] for i in self.layers}
        ledger = KVLedger(tuple({type(c) for c in layer_caches.values()}))
        with ledger, AttentionLog([self.module]) as attention:
            yield
        # Only reached when the forward returned: a crash propagates as is.
        checks = []
        for layer in self.layers:
            cache = layer_caches[layer]
            kv_calls, attention_calls = ledger.writes_to(cache), attention.calls_on(cache)
            if len(kv_calls) != 1 or len(attention_calls) != 1:
                detail = (
                    f"update_and_fetch ran {len(kv_calls)} times and attention "
                    f"{len(attention_calls)} times in one forward, not once each"
                )
                self._fail("capture", None, layer, where, detail)
                continue
            checks += self._feed(layout, layer, kv_calls[0], attention_calls[0])
        for c in checks:
            c.want, c.mask = self._reference_attention(c)
        # One evaluation for every output, batch and reference (CPU time).
        mx.eval([a for c in checks for a in (c.got, c.want, c.queries)])
        for c in checks:
            self._check_attention(c, layer_caches[c.layer], where)
        self._stop_if_failed()

    @property
    def admitted(self) -> int:
        """Tokens whose reference took the cache's other rounding choice (``_admit``)."""
        return sum(refs.admitted for refs in self.references.values())

    def settled(self, uids: Sequence[str], caches: list):
        where = f"after forward {self.forwards}"
        for layer in self.layers:
            self._check_rows(uids, layer, caches[layer], where)
        self._stop_if_failed()

    def rolled_back(self, uids: Sequence[str], n: int):
        for uid in uids:
            for layer in self.layers:
                self.references[layer].trim(uid, n)

    def extracted(self, uid: str, caches: list):
        self.check_single_caches(uid, caches, f"extract after forward {self.forwards}")
        self._stop_if_failed()

    # ------------------------------------------------------------ checks

    def check_single_caches(self, uid: str, caches: list, where: str):
        """Single-request caches (one per layer) hold exactly request ``uid``'s reference."""
        for layer in self.layers:
            cache, length = caches[layer], self.references[layer].length(uid)
            try:
                held = 0 if cache.keys is None else int(cache.offset)
                got = read_single(cache) if held else None
            except Exception as exc:  # a broken cache may fail to be read
                self._fail("extract", uid, layer, where, f"reading it raised {exc!r}")
                continue
            if held != length:
                detail = f"holds {held} tokens, the request has {length}"
                self._fail("extract", uid, layer, where, detail)
                continue
            if got is not None:
                self._compare_content("extract", uid, layer, where, got)

    def _feed(self, layout: ForwardLayout, layer: int, kv, call) -> list[_AttentionCheck]:
        """Feed each row's real columns to its reference; the attention checks to make."""
        keys, values = (to_numpy(a.astype(mx.float32)) for a in kv)
        rows = list(enumerate(zip(layout.uids, layout.real)))
        self.references[layer].append_rows(
            [
                (uid, keys[row, :, real.start : real.stop], values[row, :, real.start : real.stop])
                for row, (uid, real) in rows
            ]
        )
        return [
            _AttentionCheck(
                uid,
                layer,
                row,
                call.queries[row : row + 1, :, real.start : real.stop],
                call.output[row, :, real.start : real.stop],
                call.scale,
            )
            for row, (uid, real) in rows
        ]

    def _reference_attention(self, c: _AttentionCheck) -> tuple[mx.array, np.ndarray]:
        """The row's reference attention (lazy) and the (N, T) mask used."""
        ref_keys, ref_values = self.references[c.layer].dequantized(c.uid)
        return reference_attention(c.queries, ref_keys, ref_values, c.scale)

    def _attention_operands(self, c: _AttentionCheck):
        ref_keys, ref_values = self.references[c.layer].dequantized(c.uid)
        return attention_operands(c.queries, c.got, c.want, ref_keys, ref_values, c.mask, c.scale)

    def _check_attention(self, c: _AttentionCheck, cache, where: str):
        got, want, tol = self._attention_operands(c)
        # A wrong output shape is _record's to report, not a rounding question.
        ratios = excess_ratios(got, want, tol) if got.shape == want.shape else None
        if ratios is not None and (ratios > 1.0).any():
            if self._admit(c.uid, c.layer, lambda: read_row(cache, c.row)):
                c.want, c.mask = self._reference_attention(c)
                got, want, tol = self._attention_operands(c)
                ratios = excess_ratios(got, want, tol)
        self._record("attention", c.uid, c.layer, where, got, want, tol, ratios=ratios)

    def _check_rows(self, uids: Sequence[str], layer: int, cache, where: str):
        try:
            keys, values, left_padding = read_rows(cache)
        except Exception as exc:
            self._fail("content", None, layer, where, f"reading the batch cache raised {exc!r}")
            return
        if len(left_padding) != len(uids) or keys.shape[0] != len(uids):
            detail = (
                f"{keys.shape[0]} rows and {len(left_padding)} left paddings for "
                f"{len(uids)} requests"
            )
            self._fail("content", None, layer, where, detail)
            return
        for row, uid in enumerate(uids):
            start = left_padding[row]
            got = (keys[row, :, start:], values[row, :, start:])
            self._compare_content("content", uid, layer, where, got)

    def _compare_content(self, kind: str, uid: str, layer: int, where: str, got):
        want = self.references[layer].dequantized(uid)
        for name, mine, theirs in zip(("keys", "values"), got, want):
            shape = None if theirs is None else theirs.shape
            if mine.shape != shape:
                detail = f"{name} have shape (H, T, D) {mine.shape}, the reference {shape}"
                self._fail(kind, uid, layer, where, detail)
                return  # the values would say the same

        def judged(want):
            tols = [content_tolerance(t) for t in want]
            return tols, [excess_ratios(m, t, tol) for m, t, tol in zip(got, want, tols)]

        tols, ratios = judged(want)
        if any((r > 1.0).any() for r in ratios) and self._admit(uid, layer, lambda: got):
            want = self.references[layer].dequantized(uid)
            tols, ratios = judged(want)
        for name, mine, theirs, tol, r in zip(("keys", "values"), got, want, tols, ratios):
            self._record(kind, uid, layer, where, mine, theirs, tol, name, ratios=r)

    def _admit(self, uid: str, layer: int, read) -> bool:
        """Where a check failed: let the reference take the cache's tokens (``read()``:
        the request's (H, T, D) keys and values as the cache holds them) where they
        differ from it only as float rounding allows a correct quantizer
        (``TurboReferences.admit_rounding``); later checks compare with them.
        Returns whether any token was taken."""
        try:
            got = read()
        except Exception:  # a broken cache may fail to be read: the check fails as it was
            return False
        return self.references[layer].admit_rounding_row(uid, *got)

    def _record(self, kind, uid, layer, where, got, want, tol, name="outputs", ratios=None):
        """Count one check of ``got`` against ``want`` (``ratios``: their excess ratios,
        if the caller has them), and fail it past ``tol``."""
        if got.shape != want.shape:
            detail = f"{name} have shape {got.shape}, the reference {want.shape}"
            self._fail(kind, uid, layer, where, detail)
            return
        ratios = excess_ratios(got, want, tol) if ratios is None else ratios
        ratio = float(ratios.max()) if ratios.size else 0.0
        self.checks.setdefault(uid, RequestChecks()).add(kind, ratio)
        if not ratio <= 1.0:
            at = np.unravel_index(np.argmax(ratios), ratios.shape)
            diff = abs(float(got[at]) - float(want[at]))
            bound = float(np.broadcast_to(tol, ratios.shape)[at])
            detail = (
                f"{name} differ from the reference by up to {ratio:.3g}x the tolerance "
                f"(|diff| {diff:.3g} > {bound:.3g} at {tuple(int(i) for i in at)})"
            )
            self._fail(kind, uid, layer, where, detail)

    def _fail(self, kind, uid, layer, where, detail):
        self.failures.append(OracleFailure(kind, uid, layer, where, detail))

    def _stop_if_failed(self):
        if self.stop_at_first_failure and self.failures:
            raise CacheCheckFailed(self.failures[0].sentence())
