"""Golden scenarios, the file format: what a scenario is, reading, writing, discovering.

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

``write_failure`` turns an op sequence found by the property machine into an
unrecorded scenario. Replaying one is :mod:`tqbatch.testing.replay.replayer`'s
job, recording one :mod:`tqbatch.testing.replay.recorder`'s.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from tqbatch.testing.backend import describe as describe_backend
from tqbatch.testing.backend import matmul_precision
from tqbatch.testing.contract.ops import OPS
from tqbatch.testing.oracles.tolerances import EXACT, PACKED_CROSS_PLATFORM
from tqbatch.testing.world import World, format_ops

__all__ = [
    "DEFAULT_CONFIG",
    "Scenario",
    "ScenarioError",
    "default_tolerances",
    "discover",
    "platform_id",
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


# ---------------------------------------------------------------- the platform


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
