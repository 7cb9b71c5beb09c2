"""One forward under the request oracle: what each cache was handed, fed to the references,
and each row's attention checked.

The serving loops run their forwards through it (``serving_oracle.ServingOracle``
for ``ContinuousBatcher``, which the model matrix drives too, and for the
matrix's run of mlx-lm's ``BatchGenerator``). During the forward the
K/V handed to every watched cache object and every attention call of the
model's modules are recorded (``kv_ledger``). Afterwards each watched layer's
cache must have been handed its K/V once, or (qwen3_5) the model must have
replaced it with a ``merge`` of rows it ran alone; each row's real columns
(``ForwardLayout.real``, the server's word, never the cache's) are fed to the
request's reference, and each cache object that took K/V must have served
attention on all its query columns, which ``RequestOracle.check_attention``
judges row by row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch.testing.oracles.reference import to_numpy
from tqbatch.workbench.cache_rows import read_row
from tqbatch.workbench.kv_ledger import AttentionLog, KVLedger
from tqbatch.workbench.request_oracle import RequestOracle
from tqbatch.workbench.serving import ForwardLayout

__all__ = ["ForwardCapture"]


class ForwardCapture:
    """Captures forwards for ``oracle``.

    Args:
        oracle: the references to feed and the checks to run.
        modules: the modules whose ``scaled_dot_product_attention`` the model calls.
        watched: cache classes whose writes are recorded, beyond the classes of
            the checked layers' caches.
        batch_classes: batch classes whose ``merge`` is recorded (a model that
            runs rows alone and re-batches them).
    """

    def __init__(
        self,
        oracle: RequestOracle,
        modules: Sequence,
        watched: tuple[type, ...] = (),
        batch_classes: tuple[type, ...] = (),
    ):
        self.oracle = oracle
        self.modules = list(modules)
        self.watched = watched
        self.batch_classes = batch_classes

    @contextmanager
    def forward(
        self, layout: ForwardLayout, caches: list, where: str, layers: Sequence[int]
    ) -> Iterator[None]:
        """Around one forward over ``caches`` (a list the model may replace entries of)."""
        before = list(caches)
        classes = tuple(dict.fromkeys(self.watched + tuple(type(caches[i]) for i in layers)))
        ledger = KVLedger(classes, self.batch_classes)
        with ledger, AttentionLog(self.modules) as attention:
            yield
        # Only reached when the forward returned: a crash propagates as is.
        for layer in layers:
            served = self._attribute(ledger, layout, before[layer], caches[layer], layer, where)
            self._check_attention(attention, layout, served, layer, where)

    def _attribute(self, ledger, layout, before, after, layer: int, where: str):
        """Feed the references what the layer's cache objects were handed; returns
        ``(cache, [(row, its real query columns in that cache)], quantized)`` per object."""
        oracle = self.oracle
        if after is before:
            writes = ledger.writes_to(after)
            if len(writes) != 1:
                n = len(writes)
                detail = f"the batch cache was handed K/V {n} times in one forward, not once"
                oracle.fail("capture", None, layer, where, detail)
                return []
            keys, values = (to_numpy(a.astype(mx.float32)) for a in writes[0])
            oracle.feed_rows(
                layer,
                [
                    (uid, keys[row, :, c.start : c.stop], values[row, :, c.start : c.stop])
                    for row, (uid, c) in enumerate(zip(layout.uids, layout.real))
                ],
            )
            quantized = oracle.quantized and layer not in oracle.windows
            return [(after, list(enumerate(layout.real)), quantized)]
        # The model replaced the cache: it ran rows alone and merged them (qwen3_5).
        record = ledger.merge_into(after)
        B = len(layout.uids)
        if record is None or len(record.members) != B:
            detail = (
                f"the model replaced the batch cache with a {type(after).__name__} "
                f"no merge of {B} rows produced"
            )
            oracle.fail("capture", None, layer, where, detail)
            return []
        for row, (uid, member, cols) in enumerate(zip(layout.uids, record.members, layout.real)):
            writes = ledger.writes_to(member)
            keys = [to_numpy(k.astype(mx.float32))[0] for k, _ in writes]
            values = [to_numpy(v.astype(mx.float32))[0] for _, v in writes]
            n = sum(k.shape[1] for k in keys)
            if n != len(cols):
                detail = f"row {row} was run alone on {n} tokens, it has {len(cols)} real ones"
                oracle.fail("capture", None, layer, where, detail)
                return []
            if n:
                rows = [(uid, np.concatenate(keys, axis=1), np.concatenate(values, axis=1))]
                oracle.feed_rows(layer, rows)
        # Each member served its row alone: all of its query columns are real.
        return [
            (member, [(row, range(0, len(cols)))], isinstance(member, TurboQuantKVCache))
            for row, (member, cols) in enumerate(zip(record.members, layout.real))
        ]

    def _check_attention(self, attention, layout, served, layer: int, where: str):
        """Each cache object that took K/V served attention; check its rows."""
        for cache, rows, quantized in served:
            calls = attention.calls_on(cache)
            if not calls and not quantized:
                continue  # full precision may take a path that passes cache=None
            # Some verifiers attend one query column per call (qwen3_5's, for
            # blocks longer than 2): in order, the calls make up the block.
            width = max(cols.stop for _, cols in rows)
            if not calls or sum(c.queries.shape[2] for c in calls) != width:
                covered = [c.queries.shape[2] for c in calls]
                detail = f"attention on this cache covered {covered} query columns, not {width}"
                self.oracle.fail("capture", None, layer, where, detail)
                continue
            call = calls[0]
            if len(calls) > 1:
                call = dataclasses.replace(
                    call,
                    queries=mx.concatenate([c.queries for c in calls], axis=2),
                    output=mx.concatenate([c.output for c in calls], axis=2),
                )
            for index, (row, cols) in enumerate(rows):
                if not len(cols):
                    continue
                uid = layout.uids[row]
                self.oracle.check_attention(
                    uid,
                    layer,
                    call.queries[index : index + 1, :, cols.start : cols.stop],
                    call.output[index, :, cols.start : cols.stop],
                    call.scale,
                    f"row {row} ({uid}), {where}",
                    sinks=call.sinks,
                    quantized=quantized,
                    read_row=lambda cache=cache, index=index: read_row(cache, index),
                )
