"""Golden scenarios: a named op sequence, replayable against any implementation.

A scenario is two files side by side (format documented in tests/golden/README.md):

* ``NAME.json``, plain JSON meant to be read and edited: ``name``,
  ``description`` (the bug it pins and the upstream reference), ``upstream``,
  ``kills`` (catalogued mutants of :mod:`tqbatch.testing.mutants` it must
  fail against), ``config`` (kv_heads, head_dim, q_heads, dtype, bits,
  seed), ``ops`` (the vocabulary of docs/ops.md, one op per line),
  ``tolerances`` (one entry per recorded quantity, each with its reason) and
  ``recording`` (what recorded it, where, and a digest of config + ops);
  a saved failure also has ``found_on`` (the backend, the run's options and
  the message).
* ``NAME.npz``, the recorded expectations after every op: offsets, left
  padding, written end, masks, the raw packed bytes of ``state``, attention
  outputs, extracted rows (packed bytes and dequantized).

``replay`` runs the ops through :class:`tqbatch.testing.world.World` (the
live oracles: the numpy model, mlx-lm's ``BatchKVCache`` and per-request
``TurboQuantKVCache`` references, checked after every op) and compares every
observation with the recording. Recording happens only through ``record``
(``tqbatch record``), never during a test run. ``write_failure`` turns an op
sequence found by the property machine into an unrecorded scenario, which
``tqbatch replay`` checks against the oracles alone until it is recorded.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import re
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tqbatch.testing.backend import describe as describe_backend
from tqbatch.testing.backend import matmul_precision
from tqbatch.testing.contract.checks import ToleratedDivergence, identity, where_of
from tqbatch.testing.contract.observation import ObservationError
from tqbatch.testing.contract.ops import CHECKS, OPS, merge, recorded_quantity
from tqbatch.testing.oracles.tolerances import EXACT, PACKED_CROSS_PLATFORM
from tqbatch.testing.target import impl_spec, load_impl
from tqbatch.testing.world import World, format_ops, nested_ops

__all__ = [
    "DEFAULT_CONFIG",
    "Divergence",
    "RecordError",
    "ReplayResult",
    "Scenario",
    "ScenarioError",
    "default_tolerances",
    "discover",
    "platform_id",
    "record",
    "replay",
    "write_failure",
]

FORMAT = 1

DEFAULT_CONFIG: dict[str, Any] = {
    "kv_heads": 2,
    "head_dim": 64,
    "q_heads": 4,
    "dtype": "float32",
    "bits": 4.0,
    "seed": 0,
}
_CONFIG_KEYS = set(DEFAULT_CONFIG) | {"key_bits", "value_bits"}


def default_tolerances() -> dict[str, dict]:
    """The tolerance table written into new scenarios, one entry per recorded quantity.

    ``atol``/``rtol``: per element, ``|got - want| <= atol + rtol * |want|``; both 0
    means bit-identical bytes. ``max_mismatch_fraction``: share of elements allowed
    outside that bound. ``cross_platform`` replaces the entry when the replay runs on
    another device/OS/architecture than the recording, at the same matmul
    precision. At another precision (a float32 recording replayed at TF32) a
    quantity with a ``cross_platform`` entry (rounding-dependent: packed codes,
    dequantized values, attention) is not compared with the recording: the
    live oracles check it against bounds derived for that precision
    (``tqbatch.testing.oracles.tolerances``), where a fixed atol cannot be both tight at
    float32 and true at TF32 (attention moved by 4e-2 on an H200 at TF32).

    The quantities recorded after every op are here; what an op yields (attention
    outputs, extracted rows, trim counts) is declared with the op (``Op.recorded``).
    """
    table = {
        "offset": {**EXACT, "reason": "integers: per-row lengths are exact"},
        "left_padding": {**EXACT, "reason": "integers: per-row dead slots are exact"},
        "size": {**EXACT, "reason": "integer: the written end is exact"},
        "mask": {**EXACT, "reason": "booleans, a pure function of the geometry"},
        "has_idx": {**EXACT, "reason": "boolean: the attribute exists or not"},
        "state": {
            **EXACT,
            "reason": "TurboQuant codecs are fixed by (head_dim, bits, seed) and quantize "
            "token by token, and reshaping moves packed bits without re-quantizing: the "
            "written slots of every row are bit-identical on the recording platform "
            "(padding slots are not compared: their content is unspecified).",
            "cross_platform": PACKED_CROSS_PLATFORM,
        },
    }
    for op in OPS.values():
        for recorded in op.recorded:
            table[recorded.quantity] = recorded.tolerance
    return table


class ScenarioError(ValueError):
    """A scenario file that is malformed or cannot be replayed as written."""


class RecordError(RuntimeError):
    """Recording refused: the target diverged from the oracles."""


# ---------------------------------------------------------------- the format


@dataclass
class Scenario:
    """One golden scenario: the JSON document and, once recorded, its ``.npz``."""

    name: str
    description: str
    ops: list[dict]
    config: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_CONFIG))
    upstream: list[str] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)
    tolerances: dict[str, dict] = field(default_factory=default_tolerances)
    recording: dict | None = None
    path: Path | None = None
    # Where a saved failure was found: the backend (tqbatch.testing.backend.describe()),
    # the options of the run and the message; None for hand-written scenarios.
    found_on: dict | None = None

    # -------------------------------------------------------------- files

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ScenarioError(f"{path}: cannot read scenario JSON: {exc}") from exc
        if doc.get("format") != FORMAT:
            raise ScenarioError(f"{path}: format {doc.get('format')!r}, expected {FORMAT}")
        missing = [
            k for k in ("name", "description", "config", "ops", "tolerances") if k not in doc
        ]
        if missing:
            raise ScenarioError(f"{path}: missing field(s) {missing}")
        scenario = cls(
            name=doc["name"],
            description=doc["description"],
            ops=doc["ops"],
            config=doc["config"],
            upstream=list(doc.get("upstream", [])),
            kills=list(doc.get("kills", [])),
            tolerances=doc["tolerances"],
            recording=doc.get("recording"),
            path=path,
            found_on=doc.get("found_on"),
        )
        scenario.validate()
        return scenario

    def validate(self):
        where = self.path or self.name
        unknown = set(self.config) - _CONFIG_KEYS
        if unknown:
            raise ScenarioError(f"{where}: unknown config key(s) {sorted(unknown)}")
        missing = [k for k in DEFAULT_CONFIG if k not in self.config]
        if missing:
            raise ScenarioError(f"{where}: config lacks {missing}")
        if self.config["dtype"] != "float32":
            raise ScenarioError(
                f"{where}: dtype {self.config['dtype']!r}: the op executor generates float32 K/V"
            )
        if not isinstance(self.ops, list) or not self.ops:
            raise ScenarioError(f"{where}: ops must be a non-empty list")
        for i, op in enumerate(self.ops):
            if not isinstance(op, dict) or "op" not in op:
                raise ScenarioError(f"{where}: op {i} is not an object with an 'op' key: {op!r}")
        for quantity, tol in self.tolerances.items():
            if not tol.get("reason"):
                raise ScenarioError(f"{where}: tolerance {quantity!r} states no reason")

    @property
    def npz_path(self) -> Path:
        if self.path is None:
            raise ScenarioError(f"{self.name}: scenario has no file path")
        return self.path.with_suffix(".npz")

    def digest(self) -> str:
        """SHA-256 of config + ops: a recording is stale once either is edited."""
        canonical = json.dumps({"config": self.config, "ops": self.ops}, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_json(self) -> str:
        """The document, ops one per line so that a diff shows which op changed."""
        head = {
            "format": FORMAT,
            "name": self.name,
            "description": self.description,
            "upstream": self.upstream,
            "kills": self.kills,
            "config": self.config,
        }
        if self.found_on is not None:
            head["found_on"] = self.found_on
        parts = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in head.items()]
        ops = format_ops(self.ops).replace("\n", "\n  ")
        parts.append(f'  "ops": {ops}')
        tolerances = ",\n".join(
            f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in self.tolerances.items()
        )
        parts.append(f'  "tolerances": {{\n{tolerances}\n  }}')
        if self.recording is None:
            parts.append('  "recording": null')
        else:
            lines = ",\n".join(
                f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in self.recording.items()
            )
            parts.append(f'  "recording": {{\n{lines}\n  }}')
        return "{\n" + ",\n".join(parts) + "\n}\n"

    def save(self, path: str | Path | None = None) -> Path:
        if path is not None:
            self.path = Path(path)
        if self.path is None:
            raise ScenarioError(f"{self.name}: no path to save to")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.to_json())
        return self.path

    def world(self, impl: type) -> World:
        """A World for this scenario; a survey's failure tolerates what its search did."""
        c = self.config
        tolerated = set((self.found_on or {}).get("tolerated") or ())
        return World(
            impl,
            tolerate=(lambda failure: failure.identity in tolerated) if tolerated else None,
            bits=c["bits"],
            seed=c["seed"],
            key_bits=c.get("key_bits"),
            value_bits=c.get("value_bits"),
            kv_heads=c["kv_heads"],
            head_dim=c["head_dim"],
        )

    def resolved_ops(self) -> list[dict]:
        """The ops as executed: ``attend`` ops without ``q_heads`` take ``config.q_heads``."""
        return [_with_q_heads(op, self.config["q_heads"]) for op in self.ops]


def _with_q_heads(op: dict, q_heads: int) -> dict:
    op = dict(op)
    if op["op"] == "attend":
        op.setdefault("q_heads", q_heads)
    elif op["op"] == "expect_error":
        op["inner"] = _with_q_heads(op["inner"], q_heads)
    elif op["op"] == "extend":
        op["other"] = [_with_q_heads(o, q_heads) for o in op["other"]]
    return op


def discover(paths) -> list[Path]:
    """Scenario JSON files named by ``paths`` (files, or directories searched recursively)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found.extend(sorted(q for q in p.rglob("*.json") if _looks_like_scenario(q)))
        elif p.is_file():
            found.append(p)
        else:
            raise ScenarioError(f"{p}: no such file or directory")
    return found


def _looks_like_scenario(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------- observing


def platform_id() -> dict[str, str]:
    """Where bits are produced: device type, matmul precision, OS and CPU architecture.

    Recordings are compared bit for bit only on the same platform; the
    precision is part of it because TF32 rounds matmul operands differently.
    """
    return {
        "device": str(mx.default_device().type).rsplit(".", 1)[-1],
        "precision": matmul_precision(),
        "system": platform.system(),
        "machine": platform.machine(),
    }


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("mlx", "mlx-lm", "mlx-vlm", "numpy", "tqbatch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


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


# ---------------------------------------------------------------- recording


def record(scenario: Scenario | str | Path, impl: type | str | None = None) -> Path:
    """Replay against ``impl`` with the oracles and write the recording (``.npz``).

    Refuses (``RecordError``) if the target diverges from the oracles: a
    recording must never pin a bug. Updates the JSON's ``recording`` entry.
    """
    if not isinstance(scenario, Scenario):
        scenario = Scenario.load(scenario)
    result = replay(scenario, impl, use_recording=False)
    if result.skipped:
        raise RecordError(f"{scenario.name}: cannot record: {result.skipped}")
    if result.divergences:
        raise RecordError(
            f"{scenario.name}: the target diverges from the oracles, refusing to record:\n  "
            + "\n  ".join(map(str, result.divergences))
        )
    np.savez_compressed(scenario.npz_path, **result.observed)
    scenario.recording = {
        "npz": scenario.npz_path.name,
        "impl": result.impl,
        "platform": platform_id(),
        "versions": _versions(),
        "digest": scenario.digest(),
    }
    scenario.save()
    return scenario.npz_path


def needs_recording(scenario: Scenario) -> bool:
    """True if the scenario has no recording, a stale one, or its ``.npz`` is missing."""
    rec = scenario.recording
    return rec is None or rec.get("digest") != scenario.digest() or not scenario.npz_path.exists()


# ---------------------------------------------------------------- pinning failures


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "failure"


def config_from_world(world: World, q_heads: int | None = None) -> dict[str, Any]:
    """The scenario config of a World (e.g. the property machine's)."""
    config = dict(DEFAULT_CONFIG)
    config.update(
        kv_heads=world.kv_heads, head_dim=world.head_dim, bits=world.bits, seed=world.seed
    )
    if q_heads is not None:
        config["q_heads"] = q_heads
    for side in ("key_bits", "value_bits"):
        if getattr(world, side) is not None:
            config[side] = getattr(world, side)
    return config


def write_failure(
    ops: list[dict],
    config: dict[str, Any] | World | None,
    directory: str | Path,
    *,
    name: str | None = None,
    description: str | None = None,
    error: str | None = None,
    backend: dict | None = None,
    options: dict | None = None,
    identity: str | None = None,
    tolerated: list[str] | None = None,
) -> Path:
    """Write a failing op sequence as an (unrecorded) scenario; returns the JSON path.

    ``tqbatch replay PATH`` then reproduces the failure against the oracles.
    Once the bug is fixed, ``tqbatch record PATH`` adds the recording and the
    scenario can join the golden scenarios (``tqbatch.testing.replay.golden``). Op
    dicts are deep-copied; ``config`` is a dict of scenario config keys
    (missing ones take ``DEFAULT_CONFIG``) or a World.
    The scenario's ``found_on`` records ``backend`` (default: the current one),
    the run's ``options`` and the ``error``; for a survey's failure also the
    check ``identity`` it pins and the identities that were ``tolerated``
    when it was found (a replay tolerates them too, so it shows that one).
    """
    if isinstance(config, World):
        config = config_from_world(config)
    merged = dict(DEFAULT_CONFIG)
    merged.update(config or {})
    ops = copy.deepcopy(list(ops))
    # The target is part of the name: two targets failing on the same ops (a
    # survey of several caches into one directory) must not overwrite each other.
    target = (options or {}).get("impl")
    key = json.dumps([merged, ops, target, identity], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    if not name:
        name = f"failure_{target.rsplit(':', 1)[-1]}_{digest}" if target else f"failure_{digest}"
    name = _slug(name)
    found = time.strftime("%Y-%m-%d")
    text = description or (
        f"Found by the property machine on {found}"
        + (f": {error.splitlines()[0]}" if error else "")
        + ". Edit this description: name the bug it pins and the upstream reference."
    )
    found_on = {"backend": backend or describe_backend(), "date": found}
    if options:
        found_on["options"] = dict(options)
    if error:
        found_on["error"] = error
    if identity:
        found_on["identity"] = identity
        found_on["tolerated"] = sorted(tolerated or [])
    scenario = Scenario(name=name, description=text, ops=ops, config=merged, found_on=found_on)
    scenario.validate()
    return scenario.save(Path(directory) / f"{name}.json")
