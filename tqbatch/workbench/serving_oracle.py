"""The serving oracle (the CLI's "cache oracle"): batch caches checked against per-request
references fed the same K/V, as a serving loop reports its forwards.

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
request and layer (``tqbatch.testing.oracles.reference.TurboReferences``): exactly
those float values, so reference and batch row must hold the same codes, or
where float rounding lets a correct quantizer choose another code or float16
norm (a coordinate on a codebook midpoint, seen on a GPU), the reference
takes the cache's choice (``tqbatch.testing.oracles.rounding``) and later checks
compare with it. Then it checks, with the rounding bounds of
``tqbatch.testing.oracles.tolerances``:

* attention: row ``b``'s output on its real query columns against mlx-vlm's
  ``scaled_dot_product_attention`` over the reference's dequantized tokens
  with a causal mask (``tqbatch.workbench.reference_attention``);
* content: whenever the server says the rows are settled, each row's
  dequantized slots ``[left_padding[b], size())`` against the reference's;
* extract: each extracted single-request cache holds as many tokens as the
  reference and the same dequantized content.

Rollbacks trim the references as the server trims its batch. The references
and the checks are ``tqbatch.workbench.request_oracle.RequestOracle``'s; this
module follows a server's hooks (``ServerObserver``): ``ContinuousBatcher``'s,
also where the model matrix drives it, whose ``model_matrix.Oracle`` is this class.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tqbatch.workbench.forward_capture import ForwardCapture
from tqbatch.workbench.request_oracle import OracleFailure, RequestChecks, RequestOracle
from tqbatch.workbench.serving import ForwardLayout, ServerObserver

__all__ = [
    "CacheCheckFailed",
    "ServingOracle",
    "OracleFailure",
    "RequestChecks",
    "attention_module_of",
]


def attention_module_of(model):
    """The module whose ``scaled_dot_product_attention`` the model's attention calls.

    mlx-vlm language models import it by name into their own module (e.g.
    ``mlx_vlm.models.qwen2.language``), which is where a spy must go.
    """
    module = sys.modules[type(model).__module__]
    if not hasattr(module, "scaled_dot_product_attention"):
        raise ValueError(f"{module.__name__} has no scaled_dot_product_attention to spy on")
    return module


class CacheCheckFailed(Exception):
    """Raised from an observer hook to end the run at the first failed check."""


class ServingOracle(RequestOracle, ServerObserver):
    """Follows a ``ContinuousBatcher`` (as its observer) and checks its quantized layers.

    Args:
        model: the language model; its module's attention function is spied on.
        bits, seed: TurboQuant configuration of the references (the server's).
        quantized_layers: the layers holding the cache under test; the dense
            ones are full precision and not checked.
        stop_at_first_failure: raise ``CacheCheckFailed`` from the hook that
            found the first failure (a mutant needs no more than one).
        quantized: whether the cache under test quantizes (else its rows must
            hold the plain tokens).
        attention_modules: where the model's attention function is spied on,
            instead of ``model``'s module (a family with a speculative verifier
            has two).
        watched, batch_classes: cache classes whose writes, and batch classes
            whose ``merge``, are recorded beyond the checked layers' (``ForwardCapture``).

    After the run: ``failures`` (every failed check, in order), ``checks``
    (per request uid), ``forwards`` (forwards observed).
    """

    def __init__(
        self,
        model=None,
        *,
        bits: float,
        seed: int,
        quantized_layers: Sequence[int],
        stop_at_first_failure: bool = False,
        quantized: bool = True,
        attention_modules: Sequence | None = None,
        watched: tuple[type, ...] = (),
        batch_classes: tuple[type, ...] = (),
    ):
        super().__init__(quantized_layers, bits=bits, seed=seed, quantized=quantized)
        self.stop_at_first_failure = stop_at_first_failure
        if attention_modules is None:
            attention_modules = [attention_module_of(model)]
        self.capture = ForwardCapture(self, attention_modules, watched, batch_classes)
        self.forwards = 0

    # ------------------------------------------------------------ observer hooks

    @contextmanager
    def forward(self, layout: ForwardLayout, caches: list) -> Iterator[None]:
        self.forwards += 1
        where = f"forward {self.forwards} ({layout.kind})"
        # Sliding-window layers are watched too while a failure is diagnosed.
        with self.capture.forward(layout, caches, where, self.layers + tuple(self.windows)):
            yield
        self._stop_if_failed()

    def settled(self, uids: Sequence[str], caches: list, where: str | None = None):
        where = where or f"after forward {self.forwards}"
        for layer in self.layers:
            self.check_rows(uids, layer, caches[layer], where, label=_row_label)
        self._stop_if_failed()

    def rolled_back(self, uids: Sequence[str], n: int):
        for uid in uids:
            self.drop_last(uid, n)

    def extracted(self, uid: str, caches: list, where: str | None = None):
        self.check_single(uid, caches, where or f"extract after forward {self.forwards}")
        self._stop_if_failed()

    # ------------------------------------------------------------ checks

    def _stop_if_failed(self):
        if self.stop_at_first_failure and self.failures:
            raise CacheCheckFailed(self.failures[0].sentence())


def _row_label(row: int, uid: str) -> str:
    return f"row {row} ({uid})"
