"""Golden scenarios, replaying: a scenario's ops run against a target and compared.

``replay`` runs the ops through :class:`tqbatch.testing.world.World` (the
live oracles: the numpy model, mlx-lm's ``BatchKVCache`` and per-request
``TurboQuantKVCache`` references, checked after every op) and compares every
observation with the recording (:mod:`tqbatch.testing.replay.scenario`
describes the files). An unrecorded scenario (a saved failure) is checked
against the oracles alone until it is recorded.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tqbatch.testing.backend.codebooks import fast_codebooks
from tqbatch.testing.contract.checks import ToleratedDivergence, identity, where_of
from tqbatch.testing.contract.observation import ObservationError
from tqbatch.testing.contract.ops import CHECKS, merge, recorded_quantity
from tqbatch.testing.replay.scenario import Scenario, ScenarioError, platform_id
from tqbatch.testing.target import impl_spec, load_impl
from tqbatch.testing.world import World, nested_ops

__all__ = ["Divergence", "ReplayResult", "replay"]


# ---------------------------------------------------------------- comparing


@dataclass
class Divergence:
    """One disagreement: at which op, in which quantity, and how."""

    step: int
    op: dict | None
    quantity: str
    message: str

    def __str__(self) -> str:
        where = f"op {self.step} {json.dumps(self.op)}" if self.op is not None else "scenario"
        return f"{where}: [{self.quantity}] {self.message}"


def _request_slots(array: np.ndarray, left_padding: np.ndarray) -> np.ndarray:
    """The (row, slot) entries of a (B, H, T, ...) state leaf that hold request tokens.

    Padding slots are left out: what an implementation keeps there is unspecified.
    """
    valid = np.arange(array.shape[2])[None, :] >= left_padding[:, None]
    return np.moveaxis(array, 2, 1)[valid]


def _compare(key: str, got: np.ndarray, want: np.ndarray, tol: dict, left_padding) -> str | None:
    """None if ``got`` matches ``want`` under ``tol``; otherwise what is wrong."""
    if got.shape != want.shape:
        return f"shape {got.shape}, recorded {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, recorded {want.dtype}"
    if key.startswith("state.") and got.ndim >= 3 and left_padding is not None:
        if left_padding.shape[0] != want.shape[0]:
            return f"{want.shape[0]} rows, but {left_padding.shape[0]} recorded left paddings"
        got, want = _request_slots(got, left_padding), _request_slots(want, left_padding)
    if want.dtype.kind == "f":
        # NaN in the recording marks an unspecified value (a padding query's output).
        recorded = ~np.isnan(want)
        if np.isnan(got[recorded]).any():
            return "NaN where the recording has a value"
        got, want = got[recorded], want[recorded]
    atol, rtol = tol.get("atol", 0), tol.get("rtol", 0)
    fraction = tol.get("max_mismatch_fraction", 0)
    if atol == 0 and rtol == 0 and fraction == 0:
        if np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes():
            return None
        bad = int(np.sum(got != want)) if got.size else 0
        return f"not bit-identical: {bad} of {want.size} elements differ"
    g, w = got.astype(np.float64), want.astype(np.float64)
    outside = np.abs(g - w) > atol + rtol * np.abs(w)
    share = float(outside.mean()) if outside.size else 0.0
    if share > fraction:
        worst = float(np.max(np.abs(g - w))) if g.size else 0.0
        return (
            f"{int(outside.sum())} of {outside.size} elements outside atol={atol}, rtol={rtol} "
            f"(max |diff| {worst:.3g}; allowed share {fraction})"
        )
    return None


def _tolerance(tolerances: dict, quantity: str, cross_platform: bool) -> dict:
    tol = tolerances.get(quantity)
    if tol is None:
        raise ScenarioError(f"no tolerance stated for recorded quantity {quantity!r}")
    if cross_platform and "cross_platform" in tol:
        return tol["cross_platform"]
    return tol


# ---------------------------------------------------------------- replaying


@dataclass
class ReplayResult:
    """The outcome of one replay."""

    scenario: Scenario
    impl: str
    divergences: list[Divergence] = field(default_factory=list)
    skipped: str | None = None
    compared_with_recording: bool = False
    cross_platform: bool = False
    # The matmul precision of the recording, where it is not the replay's.
    other_precision: str | None = None
    observed: dict[str, np.ndarray] = field(default_factory=dict)
    seconds: float = 0.0
    # How the scenario's merged batches were built on the target (``merge.BY_MERGE``,
    # or ``merge.BY_PREFILL`` where it has no ``merge``); None: it merges nothing.
    construction: str | None = None
    # Identities of the failures the replay ran past (``Scenario.found_on["tolerated"]``).
    tolerated: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.divergences and self.skipped is None

    @property
    def built(self) -> str:
        """``"batches built by ..."`` (skipped: ``would be``), or "" where it merges nothing."""
        if not self.construction:
            return ""
        return f"batches {'would be ' if self.skipped else ''}built by {self.construction}"

    def __repr__(self) -> str:  # the observed arrays would drown a test report
        return f"<ReplayResult {self.summary().splitlines()[0]}>"

    def summary(self) -> str:
        name = self.scenario.name
        built = f"; {self.built}" if self.built else ""
        if self.skipped:
            return f"SKIP {name} [{self.impl}]: {self.skipped}{built}"
        against = "recording + oracles" if self.compared_with_recording else "oracles only"
        if self.other_precision:
            against += (
                f" (recorded at {self.other_precision}: rounding-dependent values "
                "by the oracles only)"
            )
        elif self.cross_platform:
            against += " (cross-platform tolerances)"
        head = f"{'PASS' if self.ok else 'FAIL'} {name} [{self.impl}] vs {against}"
        head += f"{built} in {self.seconds:.1f}s"
        return "\n  ".join([head, *map(str, self.divergences)])


def _step_key(step: int, key: str) -> str:
    return f"{step:03d}.{key}"


def replay(
    scenario: Scenario | str | Path,
    impl: type | str | None = None,
    *,
    use_recording: bool = True,
) -> ReplayResult:
    """Replay ``scenario`` against ``impl`` (default: ``load_impl()``).

    Every op goes through the World (live oracles, checked after each op);
    unless ``use_recording`` is false, every observation is also compared
    with the recording. Stops at the first op that diverges. A recording
    whose digest no longer matches the ops (or no recording at all) is
    reported as a divergence, and the ops are still checked against the oracles.
    A target without ``merge`` gets the batches a ``merge`` op asks for built
    by its constructor and a padded prefill (``tqbatch.testing.contract.ops.merge``);
    ``ReplayResult.construction`` says which construction was used.
    """
    if not isinstance(scenario, Scenario):
        scenario = Scenario.load(scenario)
    impl = impl if isinstance(impl, type) else load_impl(impl)
    result = ReplayResult(scenario, impl_spec(impl))
    start = time.perf_counter()
    recorded = None
    if use_recording:
        # A missing or stale recording is a divergence, but the ops still run
        # against the oracles, so that an unrecorded failure is reproduced.
        recorded = _load_recording(scenario, result)
    with fast_codebooks():
        world = scenario.world(impl)
        ops = scenario.resolved_ops()
        result.construction = _construction(world, ops)
        result.skipped = _unsupported(world, ops)
        if result.skipped:
            return result
        for step, op in enumerate(ops):
            if not _run_step(world, step, op, scenario, recorded, result):
                break
    result.tolerated = sorted({f.identity for f in world.tolerated})
    result.seconds = time.perf_counter() - start
    return result


def _merges(ops) -> list[dict]:
    return [o for op in ops for o in nested_ops(op) if o["op"] == "merge"]


def _construction(world: World, ops) -> str | None:
    """How the ``merge`` ops of ``ops`` build their batches on the target, joined."""
    built = {merge.construction(world, op) for op in _merges(ops)} - {None}
    return " and ".join(sorted(built)) or None


def _unsupported(world: World, ops) -> str | None:
    """Why the target cannot run ``ops``; None where it can."""
    unsupported = sorted({op["op"] for op in ops if not world.supports(op)})
    if not unsupported:
        return None
    reason = f"the target lacks what op(s) {unsupported} need"
    merge_only = sorted(
        {merge.merge_only(op) for op in _merges(ops) if merge.construction(world, op) is None}
    )
    if merge_only:
        reason += f" (it has no merge, and {'; '.join(merge_only)})"
    return reason


def _load_recording(scenario: Scenario, result: ReplayResult) -> dict | None:
    rec = scenario.recording
    if rec is None:
        result.divergences.append(
            Divergence(-1, None, "recording", "not recorded: run `tqbatch record` on it")
        )
        return None
    if rec.get("digest") != scenario.digest():
        result.divergences.append(
            Divergence(
                -1,
                None,
                "recording",
                "stale: config or ops were edited after recording; re-record with `tqbatch record`",
            )
        )
        return None
    try:
        with np.load(scenario.npz_path, allow_pickle=False) as npz:
            recorded = {k: npz[k] for k in npz.files}
    except OSError as exc:
        result.divergences.append(Divergence(-1, None, "recording", f"cannot read: {exc}"))
        return None
    result.compared_with_recording = True
    here = platform_id()
    result.cross_platform = rec.get("platform") != here
    recorded_at = (rec.get("platform") or {}).get("precision")
    if recorded_at != here.get("precision"):
        result.other_precision = str(recorded_at)
    return recorded


def _run_step(world, step, op, scenario, recorded, result) -> bool:
    """One op through the World, which checks it and observes; here only the comparison."""
    tolerated_before = len(world.tolerated)
    try:
        obs = world.step(op)
    except ObservationError as exc:
        result.divergences.append(Divergence(step, op, "observe", str(exc)))
        return False
    except ValueError as exc:  # World: an unknown op, or no batch yet
        raise ScenarioError(f"{scenario.path or scenario.name}: op {step}: {exc}") from exc
    except AssertionError as exc:
        # A CheckFailure names its check (tqbatch.testing.contract.checks); else "oracle".
        check = getattr(getattr(exc, "check", None), "name", "oracle")
        result.divergences.append(Divergence(step, op, check, getattr(exc, "what", str(exc))))
        return False
    except ToleratedDivergence as exc:  # tolerated (found_on) but the target diverged there
        result.divergences.append(Divergence(step, op, exc.failure.check.name, exc.failure.what))
        return False
    for key, array in obs.items():
        result.observed[_step_key(step, key)] = array
    if recorded is None:
        return True
    judged = {f.identity for f in world.tolerated[tolerated_before:]}
    return _compare_step(step, op, obs, scenario, recorded, result, judged)


# The live checks that judge a recorded quantity, where its name is not theirs.
_CHECKS_OF_QUANTITY = {"has_idx": ("structure",), "size": ("size", "size_type")}


def _judged_live(quantity: str, op: dict, judged: set[str]) -> bool:
    """Whether a tolerated failure of this step is of a check that judges ``quantity``.

    The check has judged the quantity against the oracles already, and its
    failure is known (listed, or what a survey tolerated): the recording
    would only report it again, under no identity, and end the replay there,
    before what the scenario pins. A check that leaves the target diverged
    ends the replay by itself (``ToleratedDivergence``).
    """
    for name in _CHECKS_OF_QUANTITY.get(quantity, (quantity,)):
        check = CHECKS.get(name)
        if check and identity(name, where_of(op) if check.per_op else None) in judged:
            return True
    return False


def _compare_step(step, op, obs, scenario, recorded, result, judged=frozenset()) -> bool:
    prefix = f"{step:03d}."
    want_keys = {k[len(prefix) :] for k in recorded if k.startswith(prefix)}
    missing = sorted(want_keys - set(obs))
    extra = sorted(set(obs) - want_keys)
    ok = True
    if missing or extra:
        result.divergences.append(
            Divergence(
                step, op, "recording", f"observed keys differ: missing {missing}, extra {extra}"
            )
        )
        ok = False
    left_padding = recorded.get(prefix + "left_padding")
    for key in sorted(want_keys & set(obs)):
        if _judged_live(recorded_quantity(key), op, judged):
            continue
        tol = _tolerance(scenario.tolerances, recorded_quantity(key), result.cross_platform)
        if (
            result.other_precision
            and "cross_platform" in scenario.tolerances[recorded_quantity(key)]
        ):
            continue  # rounding-dependent at another precision: the oracles' (see above)
        problem = _compare(key, obs[key], recorded[prefix + key], tol, left_padding)
        if problem:
            result.divergences.append(
                Divergence(step, op, recorded_quantity(key), f"{key}: {problem}")
            )
            ok = False
    return ok
