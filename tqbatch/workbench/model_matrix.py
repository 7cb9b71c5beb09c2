"""The model-family matrix: a batch cache as a drop-in inside mlx-vlm's own model code.

Each cell runs one scenario on one tiny random-weight model of one family
(``tqbatch.workbench.vlm_families``; each is a ``family.Family``, chosen by name
from ``families``) with one *target* batch cache class. Layers get their caches
by mlx-vlm's own rule (``mlx_vlm.generate.ar._make_cache`` with
TurboQuant on: the layers it would quantize hold the target; rotating,
linear-attention and last layers keep mlx-vlm's caches), and the scenario
drives the model through the workbench's serving loop, ``ContinuousBatcher``
(with a ``MatrixAdapter``: the family's caches and forward, mlx-vlm's
speculative helpers):

* ``prefill_decode``: three left-padded prompts, batched prefill, decode.
* ``continuous``: a request joins by ``extend``, one finishes (``extract`` then
  ``filter``) and decodes alone on its extracted caches, the rest go on.
* ``speculative``: verify blocks through mlx-vlm's speculative helpers
  (the model's own ``rollback_speculative_cache`` where it has one, else the
  cache transaction), each row accepting a different number of drafts.
* ``speculative_capture``: ragged verify blocks that also capture a layer's
  hidden states, as DFlash and EAGLE verify (``capture_layer_ids``).
* ``uniform_rollback``: the same with every row accepting the same number:
  a plain ``trim`` of every append-only cache.

Every request is teacher-forced with the tokens it gets run alone (single
caches of the same kinds), and two verdicts are taken:

* **the cache oracle** isolates the cache from forward noise: the K/V each
  target cache object is handed are recorded (``forward_capture``, the
  workbench's ``ServingOracle``'s too, on ``kv_ledger.KVLedger``, which also sees
  rows qwen3_5 runs alone and re-merges), each row's real columns are fed to
  a single-request reference (a ``TurboQuantKVCache`` of the same bits and
  seed, or the plain tokens for a full-precision target; where float rounding
  lets a correct quantizer pick another code or float16 norm, the reference
  takes the target's choice: ``RequestOracle.admit``), and after every
  step each row of every target layer must hold exactly its reference's
  tokens, to the rounding bound of ``tolerances.content_tolerance``; so must
  every extracted cache. Every attention call on those layers (recorded by
  ``AttentionLog`` with its queries, scale and sinks) must give, on each
  row's real query columns, what mlx-vlm's attention gives over the
  reference's tokens with a causal mask, within ``tolerances.attention_tolerance``:
  this is what sees a mask that lets a row attend padding.
* **the model-level comparison** with the request alone: the largest logit
  gap over every compared position. It includes forward noise (a batched
  forward is not bit-equal to B = 1, and at a codebook boundary that flips a
  code), so it fails a cell only beyond ``MODEL_GAP_LIMIT``, a gross error.

Every cell is run for ``BatchKVCache`` too (full precision, mlx-vlm's rule
with quantization off): where that fails or raises, the limitation is mlx-vlm's.

The ``mlx-lm:`` families (``tqbatch.workbench.lm_families``) are mlx-lm's own
model classes, run the same way under ``tqbatch.mlx_lm.routed()`` with
mlx-lm's cache rule, plus one more scenario, ``batch_generator``: mlx-lm's
real ``BatchGenerator`` under the same oracle (``tqbatch.workbench.batch_generator_scenario``).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as lm_cache
from mlx_vlm.generate.ar import _extend_cache
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.speculative.cache_state import commit_speculative_round
from mlx_vlm.speculative.common import verify_forward
from mlx_vlm.turboquant import DEFAULT_TURBOQUANT_SEED, TurboQuantKVCache
from mlx_vlm.turboquant import BatchTurboQuantKVCache as VlmBatchTurboQuantKVCache

from tqbatch.testing.oracles.reference import to_numpy
from tqbatch.workbench import families, vlm_families
from tqbatch.workbench.cache_rows import FULL_PRECISION_BATCHES
from tqbatch.workbench.family import Family
from tqbatch.workbench.request_oracle import RequestChecks
from tqbatch.workbench.serving import ContinuousBatcher, ModelAdapter, Request
from tqbatch.workbench.serving_oracle import CacheCheckFailed, ServingOracle

__all__ = [
    "ALL_FAMILIES",
    "ALL_SCENARIOS",
    "BASELINE",
    "BITS",
    "MODEL_GAP_LIMIT",
    "SCENARIOS",
    "Cell",
    "MatrixAdapter",
    "Target",
    "run_cell",
    "regressions",
    "run_matrix",
    "scenarios_for",
    "target_for",
]

BITS = 4.0
SEED = DEFAULT_TURBOQUANT_SEED
SCENARIOS = (
    "prefill_decode",
    "continuous",
    "speculative",
    "speculative_capture",
    "uniform_rollback",
)
# mlx-lm's own serving loop, for mlx-lm's own model classes only.
LM_SCENARIOS = SCENARIOS + ("batch_generator",)
ALL_SCENARIOS = LM_SCENARIOS
ALL_FAMILIES = families.NAMES
# A gross-error bound on |logits - logits alone|, for what the oracle cannot see
# (layers the target does not hold). Forward noise that flips TurboQuant codes
# moved logits by up to 3e-1 with a correct cache (tqbatch.workbench.e2e's docstring, K/V
# jittered at TF32 rounding); correct caches measure <= 1.2e-4 in every cell
# here at float32. The smallest model-level error of a real defect measured
# here: 0.705 (mlx-vlm's rotating window cache after a verify block, gpt_oss).
MODEL_GAP_LIMIT = 0.5

_WATCHED = (
    TurboQuantKVCache,
    lm_cache.KVCache,
    vlm_cache.KVCache,
    lm_cache.BatchKVCache,
    vlm_cache.BatchKVCache,
)


# ---------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """A batch cache class to put where mlx-vlm would put its BatchTurboQuantKVCache.

    ``cls`` None means full precision: mlx-vlm's rule with quantization off,
    every layer on ``BatchKVCache``.
    """

    name: str
    cls: type | None

    @property
    def quantized(self) -> bool:
        return self.cls is not None

    def batch_caches(self, model, left_padding: Sequence[int], family: Family) -> list:
        """A left-padded batch's caches by the family's rule, this target where it quantizes."""
        return family.batch_caches(model, left_padding, self.cls, BITS, SEED)

    def alone_caches(self, model, layers: Sequence[int], family: Family) -> list:
        """Single-request caches by the family's rule, TurboQuant on ``layers`` for a
        quantized target."""
        return family.alone_caches(model, layers, self.quantized, BITS, SEED)


def target_for(spec: str) -> Target:
    """``tqbatch``, ``BatchKVCache``, ``mlx-vlm`` or an import path ``module:Class``."""
    if spec == "BatchKVCache":
        return Target("BatchKVCache", None)
    if spec == "mlx-vlm":
        return Target("mlx-vlm BatchTurboQuantKVCache", VlmBatchTurboQuantKVCache)
    from tqbatch.testing.target import load_impl

    if spec == "tqbatch":
        from tqbatch import BatchTurboQuantKVCache

        return Target("tqbatch", BatchTurboQuantKVCache)
    return Target(spec, load_impl(spec))


# ---------------------------------------------------------------- requests


def _logits(model, tokens: Sequence[Sequence[int]], caches) -> mx.array:
    logits = vlm_families.forward(model, mx.array(tokens, dtype=mx.int32), caches)
    mx.eval(logits)
    return logits


def _alone_run(model, family: Family, target: Target, layers, uid, prompt, steps) -> Request:
    """Request ``uid`` run alone: greedy for ``steps`` tokens, on single-request caches;
    returned teacher-forced with those tokens and their logits alone."""
    late = target.quantized and family.prefills_rows_in_full_precision
    alone = Target("full precision", None) if late else target
    caches = alone.alone_caches(model, layers, family)
    logits = _logits(model, [prompt], caches)[0, -1]
    if late:  # quantize the prompt's tokens after the prefill, as the family's batch does
        for i in layers:
            kv, n = caches[i], int(caches[i].offset)
            caches[i] = TurboQuantKVCache(bits=BITS, seed=SEED)
            caches[i].update_and_fetch(kv.keys[..., :n, :], kv.values[..., :n, :])
    teacher, alone = [], []
    for _ in range(steps):
        token = int(mx.argmax(logits).item())
        teacher.append(token)
        alone.append(to_numpy(logits))
        logits = _logits(model, [[token]], caches)[0, -1]
    return Request(uid, list(prompt), steps, teacher=teacher, alone=alone)


# ---------------------------------------------------------------- the oracle


@dataclass
class RequestVerdict:
    """One request's share of a cell: the oracle's checks of its rows and references,
    the worst excess over the tolerance, the tokens the batch gave it and their largest
    logit gap from the request run alone."""

    uid: str
    checks: int = 0
    worst: float = 0.0
    tokens: int = 0
    gap: float | None = None


class Oracle(ServingOracle):
    """The matrix's request oracle: the workbench's ``ServingOracle`` for one target,
    stopping at the first failed check, with each layer's batch cache class
    (``classes``) to name it where the check fails."""

    def __init__(self, target: Target, layers: Sequence[int], family: Family | None = None):
        target_class = (target.cls,) if target.cls else ()
        super().__init__(
            bits=BITS,
            seed=SEED,
            quantized_layers=layers,
            stop_at_first_failure=True,
            quantized=target.quantized,
            attention_modules=_attention_modules(family) if family else [],
            watched=_WATCHED + target_class,
            batch_classes=FULL_PRECISION_BATCHES + target_class,
        )
        self.target = target
        self.classes: dict[int, str] = {}


# ---------------------------------------------------------------- the model adapter


class MatrixAdapter(ModelAdapter):
    """One family's model as ``ContinuousBatcher`` serves it in the matrix.

    The target's caches by the family's rule (``Target.batch_caches`` and
    ``alone_caches``), each batch's layer classes noted for the oracle's
    messages; mlx-vlm's forward (``vlm_families.forward``) and ``_extend_cache``;
    verify blocks as mlx-vlm's speculative decoders run them
    (speculative/dflash.py), each row rolled back to its own accepts through
    ``commit_speculative_round``.
    """

    per_row_accepts = True

    def __init__(
        self, model, family: Family, target: Target, layers, oracle: Oracle, diagnose: bool = False
    ):
        super().__init__(model)
        self.family, self.target = family, target
        self.layers = tuple(layers)
        self.oracle = oracle
        # Diagnosing a failed cell: the sliding-window layers' caches are watched too.
        self.diagnose = diagnose

    def batch_caches(self, left_padding: Sequence[int]) -> list:
        caches = self.target.batch_caches(self.model, left_padding, self.family)
        self.note_layers(caches)
        return caches

    def single_caches(self) -> list:
        return self.target.alone_caches(self.model, self.layers, self.family)

    def merge(self, singles):
        raise NotImplementedError("the matrix's scenarios do not merge")

    def note_layers(self, caches: list):
        for layer, cache in enumerate(caches):
            self.oracle.classes.setdefault(layer, type(cache).__name__)
            if self.diagnose and layer not in self.layers and hasattr(cache, "max_size"):
                self.oracle.windows.setdefault(layer, int(cache.max_size))

    def forward(self, tokens: mx.array, caches: list) -> mx.array:
        return vlm_families.forward(self.model, tokens, caches)

    def verify_forward(self, tokens: mx.array, caches: list, capture_layer_ids=None):
        # A model with its own rollback verifies in one call and rolls back
        # itself; any other in a cache transaction of mlx-vlm's helpers.
        model = self.model
        kwargs = vlm_families.call_kwargs(model, tokens, caches)
        if capture_layer_ids is not None:
            kwargs["capture_layer_ids"] = list(capture_layer_ids)
        if callable(getattr(model, "rollback_speculative_cache", None)):
            output = model(tokens, cache=caches, speculative_verify=True, **kwargs)
            return vlm_families.logits_of(output), getattr(output, "gdn_states", None)
        output, state = verify_forward(model, tokens, caches, **kwargs)
        return vlm_families.logits_of(output), state

    def extend(self, caches: list, joining: list) -> list:
        return _extend_cache(caches, joining)

    def roll_back(self, caches: list, state, accepted: Sequence[int], block: int):
        commit_speculative_round(self.model, caches, state, list(accepted), block)


def _attention_modules(family: Family) -> list:
    """The modules whose ``scaled_dot_product_attention`` the family's attention calls:
    its language module and, where it has one, its speculative verifier."""
    name = family.module
    modules = [importlib.import_module(name)]
    verifier = name.rsplit(".", 1)[0] + ".speculative_verifier"
    try:
        modules.append(importlib.import_module(verifier))
    except ImportError:
        pass
    return [m for m in modules if hasattr(m, "scaled_dot_product_attention")]


# ---------------------------------------------------------------- scenarios

PROMPTS = {"A": 9, "B": 6, "C": 3, "D": 5}
STEPS = 12  # generated tokens known per request (teacher length)


def _prompt(uid: str, vocab: int) -> list[int]:
    rng = np.random.default_rng(sum(map(ord, uid)))
    return [int(t) for t in rng.integers(1, min(vocab, 97), PROMPTS[uid])]


def _decode(server: ContinuousBatcher, steps: int):
    for _ in range(steps):
        server.step()


def _verify(server: ContinuousBatcher, accepted: Sequence[int], block: int, capture=False):
    """A verify block: row b feeds its pending token, ``accepted[b]`` right drafts, then
    wrong ones; mlx-vlm's helpers keep ``accepted[b] + 1`` tokens of each row.

    ``capture``: the target model also hands back a layer's hidden states,
    as DFlash and EAGLE verify (``capture_layer_ids``)."""
    accepts = dict(zip((r.uid for r in server.active), accepted))

    def propose(r: Request, n: int) -> list[int]:
        start, right = len(r.tokens), accepts[r.uid]
        wrong = r.teacher[start + right : start + n]
        return r.teacher[start : start + right] + [(t + 1) % 97 for t in wrong]

    layers = [server.adapter.layers[0]] if capture else None
    server.verify(propose, block, capture_layer_ids=layers)


def _scenario_prefill_decode(server: ContinuousBatcher, reqs):
    server.admit_left_padded([reqs["A"], reqs["B"], reqs["C"]])
    _decode(server, 4)


def _scenario_continuous(server: ContinuousBatcher, reqs):
    server.admit_left_padded([reqs["A"], reqs["C"]])
    _decode(server, 2)
    server.admit_left_padded([reqs["B"], reqs["D"]])
    _decode(server, 2)
    server.finish("A")
    server.decode_alone("A", 2)
    _decode(server, 2)


def _scenario_speculative(server: ContinuousBatcher, reqs):
    server.admit_left_padded([reqs["A"], reqs["B"], reqs["C"]])
    _decode(server, 1)
    _verify(server, [2, 0, 1], block=3)
    _verify(server, [0, 2, 1], block=3)
    _decode(server, 1)


def _scenario_speculative_capture(server: ContinuousBatcher, reqs):
    server.admit_left_padded([reqs["A"], reqs["B"], reqs["C"]])
    _decode(server, 1)
    # Blocks of 3 and of 2: qwen3_5's verifier attends them on different paths.
    for accepted, block in (([2, 0, 1], 3), ([0, 2, 1], 3), ([1, 0, 1], 2)):
        _verify(server, accepted, block=block, capture=True)
    _decode(server, 1)


def _scenario_uniform_rollback(server: ContinuousBatcher, reqs):
    server.admit_left_padded([reqs["A"], reqs["B"], reqs["C"]])
    _decode(server, 1)
    _verify(server, [1, 1, 1], block=3)
    _decode(server, 1)


_SCENARIO_RUNS = {
    "prefill_decode": _scenario_prefill_decode,
    "continuous": _scenario_continuous,
    "speculative": _scenario_speculative,
    "speculative_capture": _scenario_speculative_capture,
    "uniform_rollback": _scenario_uniform_rollback,
}


# ---------------------------------------------------------------- cells


@dataclass
class Cell:
    """One family x scenario x target result.

    ``status``: "PASS", "FAIL" (the oracle, or a model-level gap beyond
    ``MODEL_GAP_LIMIT`` on two identical runs), "NONDET" (a gap beyond it
    that two identical runs do not reproduce: the backend's, no verdict),
    "ERROR" (an exception from model or cache code), or "N/A". ``detail``
    says what failed or raised; ``gap`` is the largest logit distance from
    the requests run alone; ``gap_failure`` whether that gap alone failed it;
    ``admitted`` how many tokens' references took the target's other rounding
    choice (``RequestOracle.admit``); ``requests`` each request's share.
    """

    family: str
    scenario: str
    target: str
    status: str
    detail: str = ""
    gap: float | None = None
    checks: int = 0
    seconds: float = 0.0
    gap_failure: bool = False
    admitted: int = 0
    requests: tuple[RequestVerdict, ...] = ()  # per request, in prompt order

    def short(self) -> str:
        """The status and what it rests on: the gap from alone, the failed check, the error."""
        if self.status == "PASS":
            return f"PASS (logits {self.gap:.1e} from alone)"
        return f"{self.status}: {self.detail}"

    def brief(self, width: int = 70) -> str:
        """``short()`` cut to ``width`` characters, without the backend-dependent gap of a PASS."""
        text = "PASS" if self.status == "PASS" else self.short()
        return text if len(text) <= width else text[: width - 1] + "…"


_MODELS: dict[str, object] = {}  # each family's model, built once per process


def scenarios_for(name: str) -> tuple[str, ...]:
    """The scenarios a family's cells exist for: mlx-lm's loop only for mlx-lm's models."""
    return _scenarios(families.named(name))


def _scenarios(family: Family) -> tuple[str, ...]:
    return SCENARIOS + family.own_scenarios


def _model(family: Family):
    if family.name not in _MODELS:
        _MODELS[family.name] = family.build()
    return _MODELS[family.name]


def run_cell(name: str, scenario: str, target: Target) -> Cell:
    """Run one cell; never raises for a failure of the model or the cache.

    A cell that fails only by its logit gap from the requests run alone is
    run a second time: a deterministic backend gives the very same gap, and
    where the two runs disagree the gap says nothing about the cache (a GPU
    has been seen to return a batched prefill 2.4 off in the logits once in
    six identical runs, with mlx-lm's own ``BatchKVCache``). Such a cell is
    "NONDET", with both gaps, instead of "FAIL".
    """
    family = families.named(name)
    why = dict(family.not_applicable).get(scenario)
    if scenario not in _scenarios(family):
        why = "mlx-lm's BatchGenerator runs mlx-lm's model classes, not mlx-vlm's"
    if why is not None:
        return Cell(name, scenario, target.name, "N/A", why)
    cell = _run_cell_once(family, scenario, target)
    if not cell.gap_failure:
        return cell
    again = _run_cell_once(family, scenario, target)
    seconds = cell.seconds + again.seconds
    if again.gap == cell.gap:
        # The oracle passed the target's layers: run once more watching the
        # sliding-window layers too, to name the layer that first disagrees.
        diagnosis = _run_cell_once(family, scenario, target, diagnose=True)
        detail = cell.detail
        if diagnosis.status == "FAIL" and not diagnosis.gap_failure:
            detail = f"{diagnosis.detail}; {detail}"
        return dataclasses.replace(cell, detail=detail, seconds=seconds + diagnosis.seconds)
    detail = (
        f"two identical runs were {cell.gap:.3g} and {_gap_text(again.gap)} from the requests "
        "run alone: the backend is not deterministic here, no verdict"
    )
    return dataclasses.replace(cell, status="NONDET", detail=detail, seconds=seconds)


def _gap_text(gap: float | None) -> str:
    return "no gap" if gap is None else f"{gap:.3g}"


def attributed(message: str, oracle: Oracle) -> str:
    """A failed check's message with its layer's batch cache class named; a layer the
    target does not hold is said to be below the cache under test."""
    found = re.match(r"layer (\d+), ", message)
    if found is None:
        return message
    layer = int(found.group(1))
    name = f"layer {layer} `{oracle.classes.get(layer, '?')}`"
    rest = message[found.end() :]
    if layer in oracle.layers:
        return f"{name}, {rest}"
    return f"fails below the cache under test: {name} ({rest})"


def _run_cell_once(family: Family, scenario: str, target: Target, diagnose: bool = False) -> Cell:
    start = time.perf_counter()
    model = _model(family)
    layers = family.quantized_layers(model)
    oracle = Oracle(target, layers, family)
    requests: dict[str, Request] = {}
    try:
        with family.routed():
            for uid in PROMPTS:
                prompt = _prompt(uid, vlm_families.vocab_size(model))
                requests[uid] = _alone_run(model, family, target, layers, uid, prompt, STEPS)
            adapter = MatrixAdapter(model, family, target, layers, oracle, diagnose)
            if scenario == "batch_generator":
                from tqbatch.workbench import batch_generator_scenario

                batch_generator_scenario.run(adapter, requests, bits=BITS, seed=SEED)
            else:
                server = ContinuousBatcher(adapter, probe=False, observer=oracle)
                _SCENARIO_RUNS[scenario](server, requests)
    except CacheCheckFailed as exc:
        return Cell(
            family.name,
            scenario,
            target.name,
            "FAIL",
            attributed(oracle.failures[0].by_layer() if oracle.failures else str(exc), oracle),
            _gap(requests),
            oracle.total_checks,
            time.perf_counter() - start,
            admitted=oracle.admitted,
            requests=_verdicts(requests, oracle, scenario),
        )
    except Exception as exc:  # the model's or the cache's own code raised
        where = traceback.extract_tb(exc.__traceback__)[-1]
        # The first line only: some messages (nanobind's argument errors) list overloads.
        message = (str(exc).splitlines() or [""])[0]
        place = f"{where.filename.rsplit('/', 2)[-1]}:{where.lineno}"
        detail = f"{type(exc).__name__}: {message} ({place})"
        return Cell(
            family.name,
            scenario,
            target.name,
            "ERROR",
            detail,
            _gap(requests),
            oracle.total_checks,
            time.perf_counter() - start,
            admitted=oracle.admitted,
            requests=_verdicts(requests, oracle, scenario),
        )
    gap = _gap(requests)
    status, detail = "PASS", ""
    if gap is not None and gap > MODEL_GAP_LIMIT:
        status, detail = "FAIL", f"logits {gap:.3g} from the requests run alone"
    return Cell(
        family.name,
        scenario,
        target.name,
        status,
        detail,
        gap,
        oracle.total_checks,
        time.perf_counter() - start,
        gap_failure=status == "FAIL",
        admitted=oracle.admitted,
        requests=_verdicts(requests, oracle, scenario),
    )


def _verdicts(requests, oracle: Oracle, scenario: str) -> tuple[RequestVerdict, ...]:
    # The tokens fed to the model: all but ContinuousBatcher's pending last one
    # (BatchGenerator computes one step ahead, so it has fed every token it gave).
    pending = 0 if scenario == "batch_generator" else 1
    out = []
    for uid, req in requests.items():
        checks = oracle.checks.get(uid, RequestChecks())
        gap = max(req.gaps, default=None)
        fed = max(0, len(req.tokens) - pending)
        out.append(RequestVerdict(uid, checks.total, checks.worst, fed, gap))
    return tuple(out)


def _gap(requests) -> float | None:
    gaps = [g for r in requests.values() for g in r.gaps]
    return max(gaps) if gaps else None


def run_matrix(
    targets: Sequence[Target],
    family_names: Sequence[str] = vlm_families.FAMILIES,
    scenarios: Sequence[str] = SCENARIOS,
    progress: Callable[[Cell], None] | None = None,
) -> list[Cell]:
    cells = []
    for family in family_names:
        for scenario in [s for s in scenarios if s in scenarios_for(family)]:
            for target in targets:
                cell = run_cell(family, scenario, target)
                cells.append(cell)
                if progress is not None:
                    progress(cell)
    return cells


# The column every cell is also run for: where it fails too, the limitation is
# below the cache under test.
BASELINE = "BatchKVCache"


def regressions(cells: Sequence[Cell], target_name: str) -> list[Cell]:
    """Cells where ``target_name`` fails or raises and ``BASELINE`` passes (NONDET: no verdict)."""
    by_key = {(c.family, c.scenario, c.target): c for c in cells}
    return [
        c
        for c in cells
        if c.target == target_name
        and c.status in ("FAIL", "ERROR")
        and by_key.get((c.family, c.scenario, BASELINE)) is not None
        and by_key[c.family, c.scenario, BASELINE].status == "PASS"
    ]
