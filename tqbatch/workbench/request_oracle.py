"""The request oracle: per request and layer, a reference fed the K/V its batch rows were
handed, and the checks of a cache's rows, attention and extracted caches against it.

One implementation for both serving loops' judges: ``serving_oracle.ServingOracle``
(the workbench's ``ContinuousBatcher``) and ``model_matrix.Oracle`` (the model
matrix). For a quantized cache each layer's references are a
``TurboReferences`` (a ``TurboQuantKVCache`` of the same bits and seed per
request, by tokens), so that where a cache row holds another code or float16
norm that float rounding lets a correct quantizer choose (on a GPU one
coordinate in tens of thousands sits on a codebook midpoint), the reference
takes it (``admit``) and every later check compares with it. The plain tokens
are kept too: the reference of a full-precision cache, and of a sliding-window
layer checked for diagnosis (``windows``).

Every check is counted per request and kind (``checks``); a failed one is an
``OracleFailure`` handed to ``fail``, which records it (a subclass may raise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tqbatch.testing.oracles.judges import Judgement, judge, judge_tokens
from tqbatch.testing.oracles.reference import TurboReferences
from tqbatch.workbench.cache_rows import read_rows, read_single
from tqbatch.workbench.reference_attention import attention_operands, reference_attention

__all__ = ["OracleFailure", "RequestChecks", "RequestOracle"]

Tokens = tuple[np.ndarray, np.ndarray]  # (H, T, D) float32 keys and values


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

    def by_layer(self) -> str:
        """The failure led by its layer: ``layer L, WHERE: DETAIL``."""
        layer = f"layer {self.layer}, " if self.layer is not None else ""
        return f"{layer}{self.where}: {self.detail}"


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

    @property
    def total(self) -> int:
        return self.content + self.attention + self.extract

    @property
    def worst(self) -> float:
        return max(self.worst_content, self.worst_attention, self.worst_extract)


class RequestOracle:
    """References per request and layer, and the checks of caches against them.

    Args:
        layers: the layers holding the cache under test.
        bits, seed: TurboQuant configuration of the references.
        quantized: whether the cache under test quantizes (else its rows must
            hold the plain tokens).
    """

    def __init__(self, layers: Sequence[int], *, bits: float, seed: int, quantized: bool = True):
        self.layers = tuple(layers)
        self.quantized = quantized
        self.references = {layer: TurboReferences(bits=bits, seed=seed) for layer in self.layers}
        self.tokens: dict[tuple[str, int], list[Tokens]] = {}
        # Sliding-window layers also checked (diagnosis), against the plain tokens
        # with the window's mask: layer -> window.
        self.windows: dict[int, int] = {}
        self.checks: dict[str, RequestChecks] = {}
        self.failures: list[OracleFailure] = []

    @property
    def admitted(self) -> int:
        """Tokens whose reference took a cache's other rounding choice (``admit``)."""
        return sum(refs.admitted for refs in self.references.values())

    @property
    def total_checks(self) -> int:
        return sum(c.total for c in self.checks.values())

    @property
    def worst(self) -> float:
        return max((c.worst for c in self.checks.values()), default=0.0)

    # ------------------------------------------------------------ references

    def feed_rows(self, layer: int, rows: Sequence[tuple[str, np.ndarray, np.ndarray]]):
        """Append each ``(uid, keys, values)`` ((H, n, D)) to that request's reference."""
        rows = [(uid, k, v) for uid, k, v in rows if k.shape[1]]
        for uid, keys, values in rows:
            self.tokens.setdefault((uid, layer), []).append((keys, values))
        if self.quantized and layer in self.references:
            self.references[layer].append_rows(rows)

    def drop_last(self, uid: str, n: int):
        """Forget request ``uid``'s last ``n`` tokens at every layer (a rolled-back tail)."""
        if n <= 0:
            return
        for layer in self.layers + tuple(self.windows):
            got = self._plain(uid, layer)
            if got is None:
                continue
            keys, values = got
            self.tokens[uid, layer] = [
                (keys[:, : keys.shape[1] - n], values[:, : values.shape[1] - n])
            ]
            if self.quantized and layer in self.references:
                self.references[layer].trim(uid, n)

    def _plain(self, uid: str, layer: int) -> Tokens | None:
        parts = self.tokens.get((uid, layer), [])
        if not parts:
            return None
        return tuple(np.concatenate([p[i] for p in parts], axis=1) for i in range(2))

    def want(self, uid: str, layer: int, quantized: bool | None = None) -> Tokens | None:
        """The reference's (H, T, D) keys and values: the tokens, quantized if the cache is
        (or if ``quantized`` says the cache object checked is)."""
        quantized = self.quantized if quantized is None else quantized
        if not quantized or layer in self.windows:
            return self._plain(uid, layer)
        keys, values = self.references[layer].dequantized(uid)
        return None if keys is None else (keys, values)

    def admit(self, uid: str, layer: int, read: Callable[[], Tokens | None]) -> bool:
        """Where a check failed: let the reference take the cache's tokens (``read()``:
        the request's (H, T, D) keys and values as the cache holds them) where they
        differ from it only as float rounding allows a correct quantizer
        (``TurboReferences.admit_rounding``); later checks compare with them.
        Returns whether any token was taken."""
        if not self.quantized or layer not in self.references:
            return False
        try:
            got = read()
        except Exception:  # a broken cache may fail to be read: the check fails as it was
            return False
        return got is not None and self.references[layer].admit_rounding_row(uid, *got)

    # ------------------------------------------------------------ checks

    def check_rows(self, uids: Sequence[str], layer: int, cache, where: str, label=None):
        """Each row of a batch cache holds exactly its request's reference.

        ``label(row, uid)``: how a row is named in messages (default: by its uid)."""
        try:
            keys, values, padding = read_rows(cache)
        except Exception as exc:  # a broken cache may fail to be read
            self.fail("content", None, layer, where, f"reading the batch raised {exc!r}")
            return
        if keys.shape[0] != len(uids) or len(padding) != len(uids):
            detail = (
                f"{keys.shape[0]} rows and {len(padding)} left paddings for {len(uids)} requests"
            )
            self.fail("content", None, layer, where, detail)
            return
        for row, uid in enumerate(uids):
            got = keys[row, :, padding[row] :], values[row, :, padding[row] :]
            at = where if label is None else f"{label(row, uid)}, {where}"
            self.compare("content", uid, layer, at, got)

    def check_single(self, uid: str, caches: list, where: str):
        """Single-request caches (one per layer) hold exactly request ``uid``'s reference."""
        for layer in self.layers:
            try:
                got = read_single(caches[layer])
            except Exception as exc:  # a broken cache may fail to be read
                self.fail("extract", uid, layer, where, f"reading it raised {exc!r}")
                continue
            self.compare("extract", uid, layer, where, got)

    def compare(self, kind: str, uid: str, layer: int, where: str, got: Tokens | None):
        """``got`` (the request's tokens as a cache holds them) against its reference."""
        want = self.want(uid, layer)
        n_got = 0 if got is None else got[0].shape[1]
        n_want = 0 if want is None else want[0].shape[1]
        if not n_got or not n_want:
            if n_got != n_want:
                detail = f"holds {n_got} tokens, the request has {n_want}"
                self.fail(kind, uid, layer, where, detail)
            return
        for name, mine, theirs in zip(("keys", "values"), got, want):
            if mine.shape != theirs.shape:
                detail = f"{name} (H, T, D) {mine.shape}, the reference's {theirs.shape}"
                self.fail(kind, uid, layer, where, detail)
                return  # the values would say the same
        for side, name in enumerate(("keys", "values")):
            judgement = judge_tokens(
                got[side],
                lambda: self.want(uid, layer)[side],  # noqa: B023 (judged at once)
                lambda tol: self.admit(uid, layer, lambda: got),
            )
            self.record(kind, uid, layer, where, judgement, name)

    def check_attention(
        self,
        uid: str,
        layer: int,
        queries: mx.array,
        got: mx.array,
        scale: float,
        where: str,
        *,
        sinks: mx.array | None = None,
        quantized: bool | None = None,
        read_row: Callable[[], Tokens | None] | None = None,
    ):
        """A row's (Hq, N, D) attention output on its real query columns ((1, Hq, N, D)
        ``queries``) against mlx-vlm's attention over the request's reference with a
        causal mask (the same scale and sinks).

        ``quantized`` says which reference the cache object that served the call
        must match: a TurboQuant one, or the plain tokens. ``read_row()`` reads the
        row as that cache holds it, for ``admit`` where the output differs.
        """

        def operands():
            ref_keys, ref_values = self.want(uid, layer, quantized)
            window = self.windows.get(layer)
            want, mask = reference_attention(queries, ref_keys, ref_values, scale, sinks, window)
            return attention_operands(queries, got, want, ref_keys, ref_values, mask, scale)

        mine, theirs, _ = operands()
        if mine.shape != theirs.shape:  # not a rounding question
            detail = f"attention output has shape {mine.shape}, the reference {theirs.shape}"
            self.fail("attention", uid, layer, where, detail)
            return
        quantized = self.quantized if quantized is None else quantized
        admit = None
        if quantized and read_row is not None:
            admit = lambda: self.admit(uid, layer, read_row)  # noqa: E731
        self.record("attention", uid, layer, where, judge(operands, admit), "attention output")

    def record(self, kind, uid, layer, where, judgement: Judgement, name="keys"):
        """Count one check (``judges``), and fail it where the judgement did not pass."""
        self.checks.setdefault(uid, RequestChecks()).add(kind, judgement.ratio)
        if not judgement.passed:
            verb = "differs" if name == "attention output" else "differ"
            self.fail(
                kind, uid, layer, where, f"{name} {verb} from the reference {judgement.detail()}"
            )

    def fail(self, kind: str, uid: str | None, layer: int | None, where: str, detail: str):
        self.failures.append(OracleFailure(kind, uid, layer, where, detail))
