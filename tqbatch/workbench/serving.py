"""A server-like continuous-batching greedy decoder over TurboQuant layer caches.

``ContinuousBatcher`` drives a language model the way a batching server does:
requests join a running batch (left-padded prefill, right-padded prefill then
``finalize``, or prefilled alone and ``merge``-d), decode together, leave when
they reach their token budget (``extract`` then ``filter``) and can be rolled
back after a speculative verify block (``trim``). Every layer holds a
``tqbatch.BatchTurboQuantKVCache`` except the ``dense_layers``, which hold a
full-precision mlx-lm ``BatchKVCache`` (omlx keeps the last layer dense).

The loop takes a ``ModelAdapter``: how to make the model's caches, call it,
join batches and roll verify blocks back. ``TurboQuantLayersAdapter`` is
tqbatch's own layout (above); the model-family matrix
(``tqbatch.workbench.model_matrix``) drives mlx-vlm's and mlx-lm's model
classes through its own adapter, finishing named rows (``finish``) and
decoding them alone on their extracted caches (``decode_alone``).

The model builds one attention mask per forward from the first layer's cache
and hands it to every layer; ``MaskWidthProbe`` wraps the layers to check that
each layer's cache agrees with that mask's width, so a dense layer and a
TurboQuant layer can never silently drift apart (omlx #2237).

An optional ``ServerObserver`` is told what the server knows and a cache
must not be trusted to report: which input columns of each row hold a
request's tokens (``ForwardLayout``), when rows are settled, rolled back or
extracted. ``tqbatch.workbench.serving_oracle`` uses it to check the caches.

Under ``TurboQuantLayersAdapter`` the model must be an mlx-lm style module:
``model(tokens, cache=list)`` returns logits ``(B, T, vocab)`` and
``model.layers`` is the list of blocks, called as ``block(x, mask, cache)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.cache import BatchableTurboQuantKVCache, BatchTurboQuantKVCache
from tqbatch.testing.oracles.reference import to_numpy

__all__ = [
    "BatchableTurboQuantKVCache",
    "ContinuousBatcher",
    "FinishedRequest",
    "ForwardLayout",
    "MaskGeometryError",
    "MaskWidthProbe",
    "ModelAdapter",
    "Request",
    "ServerObserver",
    "TurboQuantLayersAdapter",
    "cache_key_length",
]


class MaskGeometryError(RuntimeError):
    """A layer's cache disagrees with the mask shared by all layers of a forward."""


@dataclass
class Request:
    """One generation request and everything decoded for it so far.

    ``logits[j]`` is the (vocab,) float32 row that produced ``tokens[j]``:
    greedy, ``tokens[j] == argmax(logits[j])``, unless a ``teacher`` is set,
    in which case ``tokens[j] == teacher[j]`` whatever the logits say (teacher
    forcing: the batched run follows a known sequence, so a float-noise flip of
    its argmax cannot derail it). The last token is *pending*: generated but
    not yet fed to the model.

    ``alone[j]``, where given, is the (vocab,) logits row that produced
    ``teacher[j]`` with the request run alone; ``gaps`` then gets, per recorded
    step, the largest distance of the batch's logits from it.
    """

    uid: str
    prompt: list[int]
    max_new_tokens: int
    teacher: list[int] | None = None
    tokens: list[int] = field(default_factory=list)
    logits: list[mx.array] = field(default_factory=list)
    alone: list[np.ndarray] | None = None
    gaps: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError(f"request {self.uid!r} has an empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.uid!r}: max_new_tokens must be >= 1")
        if self.teacher is not None and len(self.teacher) < self.max_new_tokens:
            raise ValueError(
                f"request {self.uid!r}: the teacher has {len(self.teacher)} tokens, "
                f"fewer than max_new_tokens {self.max_new_tokens}"
            )

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    def next_tokens(self, logits: mx.array) -> list[int]:
        """The tokens this request takes from consecutive (block, vocab) logits rows.

        Row ``j`` predicts ``tokens[len(tokens) + j]``: the teacher's token
        where it has one (-1, matching nothing, past its end), else the argmax.
        """
        if self.teacher is None:
            return [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
        start = len(self.tokens)
        return [
            self.teacher[i] if i < len(self.teacher) else -1
            for i in range(start, start + logits.shape[0])
        ]

    def record(self, logits: mx.array):
        """Append one step from a (vocab,) logits row: the teacher's token or the argmax."""
        token = self.next_tokens(logits[None])[0]
        if self.alone is not None and len(self.tokens) < len(self.alone):
            self.gaps.append(float(np.abs(to_numpy(logits) - self.alone[len(self.tokens)]).max()))
        self.logits.append(logits)
        self.tokens.append(token)


@dataclass
class FinishedRequest:
    """A request that left the batch, with its per-layer single-request caches.

    The caches hold the prompt and every generated token except the pending
    last one, exactly as a server would keep them for a prefix cache.
    """

    request: Request
    caches: list


@dataclass(frozen=True)
class ForwardLayout:
    """What one forward feeds: each row's request and which of its input columns are real.

    ``real[b]`` is the range of input columns of row ``b`` that carry request
    ``uids[b]``'s tokens; the others are padding. ``kind`` names the operation
    (for messages). ``batched`` is False for a request prefilled alone in
    single-request caches (``admit_merged``).
    """

    kind: str
    uids: tuple[str, ...]
    real: tuple[range, ...]
    batched: bool = True


class ServerObserver:
    """Hooks through which a test oracle follows the server; each one here does nothing.

    * ``forward(layout, caches)``: a context manager around every model forward.
    * ``settled(uids, caches)``: the batch caches' rows hold exactly the
      requests ``uids`` (right padding finalized, verify blocks rolled back):
      after every batched decode or verify, and after every join.
    * ``rolled_back(uids, n)``: every row of the batch was trimmed by ``n``.
    * ``extracted(uid, caches)``: ``caches`` are what ``extract`` returned for
      a finished request, one per layer.

    ``where``, where a hook takes it: the server's name for the moment, for messages.
    """

    @contextmanager
    def forward(self, layout: ForwardLayout, caches: list) -> Iterator[None]:
        yield

    def settled(self, uids: Sequence[str], caches: list, where: str | None = None):
        pass

    def rolled_back(self, uids: Sequence[str], n: int):
        pass

    def extracted(self, uid: str, caches: list, where: str | None = None):
        pass


def cache_key_length(cache) -> int:
    """Number of key slots ``cache`` hands to attention (padding included).

    Batch caches (anything with ``left_padding``) report it as ``size()``, the
    written end; single-request caches hold exactly ``offset`` slots.
    """
    if hasattr(cache, "left_padding"):
        return int(cache.size())
    return int(cache.offset)


class _ProbedLayer(nn.Module):
    """Reports (mask, cache) to the probe before and after the wrapped block runs."""

    def __init__(self, block: nn.Module, index: int, probe: MaskWidthProbe):
        super().__init__()
        self.block = block
        self._index = index
        self._probe = probe

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        self._probe.before(self._index, x.shape[1], mask, cache)
        out = self.block(x, mask, cache, *args, **kwargs)
        self._probe.after(self._index, mask, cache)
        return out


class MaskWidthProbe:
    """Checks, layer by layer, that the shared mask fits every layer's cache.

    Every layer of one forward must receive the very mask object built for
    layer 0. An array mask for ``N`` new tokens must be as wide as the keys
    the layer's cache held before the forward plus ``N`` (checked before the
    layer runs, so a mismatch is reported as such rather than as a broadcast
    error deep inside attention), and as wide as the keys it holds after
    writing them.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.checks = 0  # (layer, forward) pairs whose array mask was checked
        self._first_mask = None
        layers = model.layers
        for i, block in enumerate(layers):
            if isinstance(block, _ProbedLayer):
                raise ValueError("this model already carries a MaskWidthProbe")
            layers[i] = _ProbedLayer(block, i, self)

    def _fail(self, index: int, cache, width: int, keys: int, when: str):
        raise MaskGeometryError(
            f"layer {index} ({type(cache).__name__}): the shared mask has {width} columns, "
            f"the cache {when} {keys} key slots"
        )

    def before(self, index: int, n_new: int, mask, cache):
        if index == 0:
            self._first_mask = mask
        elif mask is not self._first_mask:
            raise MaskGeometryError(
                f"layer {index} received a different mask object than layer 0: "
                "the mask must be built once per forward and shared"
            )
        if cache is None or not isinstance(mask, mx.array):
            return  # "causal" / None masks carry no width to disagree on
        width, keys = mask.shape[-1], cache_key_length(cache) + n_new
        if width != keys:
            self._fail(index, cache, width, keys, f"will hold (with {n_new} new)")

    def after(self, index: int, mask, cache):
        if cache is None or not isinstance(mask, mx.array):
            return
        width, keys = mask.shape[-1], cache_key_length(cache)
        if width != keys:
            self._fail(index, cache, width, keys, "holds")
        self.checks += 1

    def remove(self):
        """Put the original blocks back."""
        layers = self.model.layers
        for i, block in enumerate(layers):
            if isinstance(block, _ProbedLayer) and block._probe is self:
                layers[i] = block.block


DraftProposer = Callable[[Request, int], Sequence[int]]


class ModelAdapter:
    """How the loop makes one model's caches, calls it, joins batches and rolls verify
    blocks back: the one interface ``ContinuousBatcher`` takes.

    The caches are each subclass's own (``single_caches``, ``batch_caches``,
    ``merge``). What is here serves a model called as ``model(tokens,
    cache=caches)`` that returns logits: a joining batch is ``extend``-ed in
    place and a verify block is rolled back by one ``trim`` of every cache, so
    every row accepts the same number of drafts (``per_row_accepts`` False).
    """

    per_row_accepts = False

    def __init__(self, model: nn.Module):
        self.model = model

    def single_caches(self) -> list:
        """Fresh single-request caches, one per layer."""
        raise NotImplementedError

    def batch_caches(self, left_padding: Sequence[int]) -> list:
        """Fresh, empty batch caches with the given left padding, one per layer."""
        raise NotImplementedError

    def merge(self, singles: Sequence[list]) -> list:
        """One batch cache per layer ``merge``-d from each request's single caches."""
        raise NotImplementedError

    def forward(self, tokens: mx.array, caches: list) -> mx.array:
        """(B, T) tokens -> (B, T, vocab) logits, writing the tokens into ``caches``."""
        return self.model(tokens, cache=caches)

    def verify_forward(self, tokens: mx.array, caches: list, capture_layer_ids=None):
        """A verify block's forward: (logits, the state ``roll_back`` needs)."""
        if capture_layer_ids is not None:
            raise ValueError("this adapter's model does not capture hidden states")
        return self.forward(tokens, caches), None

    def extend(self, caches: list, joining: list) -> list:
        """The running batch's caches with a prefilled batch's rows appended."""
        for mine, theirs in zip(caches, joining):
            mine.extend(theirs)
        return caches

    def roll_back(self, caches: list, state, accepted: Sequence[int], block: int):
        """Keep ``accepted[b] + 1`` of the ``block`` verified tokens of every row ``b``."""
        (n,) = {block - 1 - a for a in accepted}
        for c in caches:
            if c.trim(n) != n:
                raise RuntimeError(f"{type(c).__name__}.trim({n}) trimmed fewer slots")


class TurboQuantLayersAdapter(ModelAdapter):
    """tqbatch's layout: every layer a quantized batch cache (``batch_cache_class``, the
    quantized batch cache under test: tqbatch's by default, the harness passes
    ``load_impl()`` or a mutant) except the ``dense_layers`` (default the last), which
    hold mlx-lm's ``BatchKVCache``."""

    def __init__(
        self,
        model: nn.Module,
        *,
        bits: float = 4.0,
        seed: int = 0,
        dense_layers: Sequence[int] | None = None,
        batch_cache_class: type = BatchTurboQuantKVCache,
    ):
        super().__init__(model)
        n_layers = len(model.layers)
        dense = {n_layers - 1} if dense_layers is None else set(dense_layers)
        bad = sorted(i for i in dense if not 0 <= i < n_layers)
        if bad:
            raise ValueError(f"dense_layers {bad} out of range for {n_layers} layers")
        self.bits = bits
        self.seed = seed
        self.dense_layers = frozenset(dense)
        self.batch_cache_class = batch_cache_class
        self.n_layers = n_layers

    def single_caches(self) -> list:
        """Fresh single-request caches, one per layer."""
        return [
            KVCache()
            if i in self.dense_layers
            else TurboQuantKVCache(bits=self.bits, seed=self.seed)
            for i in range(self.n_layers)
        ]

    def batch_caches(self, left_padding: Sequence[int]) -> list:
        """Fresh, empty batch caches with the given left padding, one per layer."""
        return [
            BatchKVCache(list(left_padding))
            if i in self.dense_layers
            else self.batch_cache_class(list(left_padding), bits=self.bits, seed=self.seed)
            for i in range(self.n_layers)
        ]

    def merge(self, singles: Sequence[list]) -> list:
        """One batch cache per layer ``merge``-d from each request's single caches."""
        return [
            (BatchKVCache if i in self.dense_layers else self.batch_cache_class).merge(
                [caches[i] for caches in singles]
            )
            for i in range(self.n_layers)
        ]


class ContinuousBatcher:
    """Continuous batched greedy decoding with one cache per layer.

    Args:
        adapter: the model and how to make its caches, call it, join and roll
            back (``TurboQuantLayersAdapter``: tqbatch's layer layout).
        probe: check mask width against every layer's cache on each forward.
        observer: told the layout of every forward and every rollback,
            settling and extraction (see ``ServerObserver``).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        *,
        probe: bool = True,
        observer: ServerObserver | None = None,
    ):
        self.model = adapter.model
        self.adapter = adapter
        self.probe = MaskWidthProbe(adapter.model) if probe else None
        self.observer = observer if observer is not None else ServerObserver()
        self.active: list[Request] = []
        self.caches: list | None = None
        self.finished: dict[str, FinishedRequest] = {}
        self.forwards = 0
        self.trimmed = 0  # slots rolled back by speculative verification (the most of any row)

    # ------------------------------------------------------------------ forwards

    def _forward(self, tokens: mx.array, caches: list, layout: ForwardLayout) -> mx.array:
        logits, _ = self._observed(
            layout, caches, lambda: (self.adapter.forward(tokens, caches), None)
        )
        return logits

    def _observed(self, layout: ForwardLayout, caches: list, call: Callable[[], tuple]):
        """``call()``'s (logits, state) under the observer, the logits float32 and evaluated."""
        with self.observer.forward(layout, caches):
            logits, state = call()
            logits = logits.astype(mx.float32)
            mx.eval(logits)
        self.forwards += 1
        return logits, state

    def _uids(self, requests: Sequence[Request]) -> tuple[str, ...]:
        return tuple(r.uid for r in requests)

    # ------------------------------------------------------------------ admission

    def admit_left_padded(self, requests: Sequence[Request], *, via_prepare: bool = False):
        """Prefill ``requests`` as one left-padded batch, then join the running batch.

        The padding goes to the cache constructor, or with ``via_prepare`` to
        ``prepare(left_padding=...)`` on caches built unpadded.
        """
        requests = list(requests)
        longest = max(len(r.prompt) for r in requests)
        padding = [longest - len(r.prompt) for r in requests]
        if via_prepare:
            caches = self.adapter.batch_caches([0] * len(requests))
            for c in caches:
                c.prepare(left_padding=padding)
        else:
            caches = self.adapter.batch_caches(padding)
        tokens = mx.array([[0] * p + r.prompt for p, r in zip(padding, requests)])
        real = tuple(range(p, longest) for p in padding)
        layout = ForwardLayout("left-padded prefill", self._uids(requests), real)
        logits = self._forward(tokens, caches, layout)
        for row, r in enumerate(requests):
            r.record(logits[row, -1])
        self._join(requests, caches, "left-padded prefill")

    def admit_right_padded(self, requests: Sequence[Request]):
        """Prefill right-padded (``prepare(right_padding=...)`` + ``finalize``), then join."""
        requests = list(requests)
        lengths = [len(r.prompt) for r in requests]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        caches = self.adapter.batch_caches([0] * len(requests))
        for c in caches:
            c.prepare(lengths=lengths, right_padding=padding)
        tokens = mx.array([r.prompt + [0] * p for p, r in zip(padding, requests)])
        real = tuple(range(n) for n in lengths)
        layout = ForwardLayout("right-padded prefill", self._uids(requests), real)
        logits = self._forward(tokens, caches, layout)
        for c in caches:
            c.finalize()
        for row, (r, n) in enumerate(zip(requests, lengths)):
            r.record(logits[row, n - 1])  # the last real token, not the padding
        self._join(requests, caches, "right-padded prefill (finalized)")

    def admit_merged(self, requests: Sequence[Request]):
        """Prefill each request alone in single-request caches, ``merge`` them, then join."""
        requests = list(requests)
        singles = []
        for r in requests:
            caches = self.adapter.single_caches()
            layout = ForwardLayout(
                "prefill alone", (r.uid,), (range(len(r.prompt)),), batched=False
            )
            logits = self._forward(mx.array([r.prompt]), caches, layout)
            r.record(logits[0, -1])
            singles.append(caches)
        self._join(requests, self.adapter.merge(singles), "merge")

    def _join(self, requests: list[Request], caches: list, where: str):
        # The joining rows are checked on their own caches first, so that a
        # failure there names the prefill rather than the extend.
        self.observer.settled(self._uids(requests), caches, where)
        self.active.extend(requests)
        if self.caches is None:
            self.caches = caches
        else:
            self.caches = self.adapter.extend(self.caches, caches)
            self.observer.settled(self._uids(self.active), self.caches, "extend")
        self._retire()

    # ------------------------------------------------------------------ decoding

    def step(self):
        """Feed every active request its pending token and decode one more."""
        if not self.active:
            raise RuntimeError("step: no active requests")
        pending = mx.array([[r.tokens[-1]] for r in self.active])
        uids = self._uids(self.active)
        layout = ForwardLayout("decode", uids, (range(1),) * len(uids))
        logits = self._forward(pending, self.caches, layout)
        for row, r in enumerate(self.active):
            r.record(logits[row, -1])
        self.observer.settled(uids, self.caches, "decode")
        self._retire()

    def verify(self, propose: DraftProposer, block: int, capture_layer_ids=None) -> int:
        """One speculative step: verify ``block - 1`` drafted tokens per row at once.

        Feeds ``[pending, d_1, ..., d_{block-1}]`` to every row; a row accepts
        the longest draft prefix its predictions confirm (greedy, or the
        teacher's tokens under teacher forcing). Unless the adapter rolls rows
        back one by one (``per_row_accepts``), every row accepts the fewest
        any row does, so one ``trim`` serves the whole batch. The rest is
        rolled back and the accepted steps recorded. ``capture_layer_ids``:
        the model also hands back those layers' hidden states, as DFlash and
        EAGLE verify. Returns the number of drafts every row accepted.
        Acceptance is capped so no request exceeds its budget.
        """
        if not self.active:
            raise RuntimeError("verify: no active requests")
        if block < 2:
            raise ValueError(f"verify needs a block of at least 2 tokens, got {block}")
        drafts = []
        for r in self.active:
            d = [int(t) for t in propose(r, block - 1)]
            if len(d) != block - 1:
                raise ValueError(f"proposer gave {len(d)} drafts for {r.uid!r}, wanted {block - 1}")
            drafts.append(d)
        inputs = mx.array([[r.tokens[-1]] + d for r, d in zip(self.active, drafts)])
        uids = self._uids(self.active)
        layout = ForwardLayout(f"verify {block}-token block", uids, (range(block),) * len(uids))
        logits, state = self._observed(
            layout,
            self.caches,
            lambda: self.adapter.verify_forward(inputs, self.caches, capture_layer_ids),
        )

        accepted = []
        for row, (r, d) in enumerate(zip(self.active, drafts)):
            predicted = r.next_tokens(logits[row])
            n = 0
            while n < len(d) and predicted[n] == d[n]:
                n += 1
            # Recording n + 1 steps must stay within the budget.
            accepted.append(max(0, min(n, r.remaining - 1)))
        if not self.adapter.per_row_accepts:
            accepted = [min(accepted)] * len(accepted)

        self.adapter.roll_back(self.caches, state, accepted, block)
        self.trimmed += max(block - 1 - a for a in accepted)
        for uid, a in zip(uids, accepted):
            if block - 1 - a:
                self.observer.rolled_back([uid], block - 1 - a)
        for row, (r, a) in enumerate(zip(self.active, accepted)):
            for j in range(a + 1):
                r.record(logits[row, j])
        self.observer.settled(uids, self.caches, f"commit {accepted}")
        self._retire()
        return min(accepted)

    # ------------------------------------------------------------------ leaving

    def _retire(self):
        """Move finished requests out of the batch: ``extract`` each, then one ``filter``."""
        done = [i for i, r in enumerate(self.active) if r.done]
        if not done:
            return
        for i in done:
            r = self.active[i]
            self.finished[r.uid] = FinishedRequest(r, [c.extract(i) for c in self.caches])
            self.observer.extracted(r.uid, self.finished[r.uid].caches)
        keep = [i for i, r in enumerate(self.active) if not r.done]
        if keep:
            for c in self.caches:
                c.filter(keep)
        else:
            self.caches = None  # filter([]) is not a thing: the batch is gone
        self.active = [self.active[i] for i in keep]

    def finish(self, uid: str) -> FinishedRequest:
        """End request ``uid`` before its budget, as a server does on a stop: ``extract``
        its row, then ``filter`` the others."""
        row = self._uids(self.active).index(uid)
        r = self.active[row]
        self.finished[uid] = FinishedRequest(r, [c.extract(row) for c in self.caches])
        self.observer.extracted(uid, self.finished[uid].caches, f"extract of {uid}")
        keep = [i for i in range(len(self.active)) if i != row]
        for c in self.caches:
            c.filter(mx.array(keep, dtype=mx.int32))
        self.active = [self.active[i] for i in keep]
        self.observer.settled(self._uids(self.active), self.caches, f"filter {keep}")
        return self.finished[uid]

    def decode_alone(self, uid: str, steps: int):
        """Decode finished request ``uid`` ``steps`` more tokens alone on its extracted caches,
        as a server does that reuses a prefix cache."""
        finished = self.finished[uid]
        r = finished.request
        for _ in range(steps):
            layout = ForwardLayout(f"{uid} alone", (uid,), (range(1),))
            logits = self._forward(mx.array([[r.tokens[-1]]]), finished.caches, layout)
            r.record(logits[0, -1])
        self.observer.extracted(uid, finished.caches, "decoding alone after extract")

    def run_until_idle(self, max_forwards: int = 10_000):
        """Decode until every active request has finished."""
        while self.active:
            if self.forwards >= max_forwards:
                raise RuntimeError(
                    f"still {len(self.active)} requests after {max_forwards} forwards"
                )
            self.step()
