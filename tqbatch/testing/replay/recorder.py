"""Golden scenarios, recording: a target's observations, checked by the oracles, saved.

Recording happens only through ``record`` (``tqbatch record``), never during
a test run, and never from a target that diverges from the oracles.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import numpy as np

from tqbatch.testing.replay.replayer import replay
from tqbatch.testing.replay.scenario import Scenario, platform_id

__all__ = ["RecordError", "needs_recording", "record"]


class RecordError(RuntimeError):
    """Recording refused: the target diverged from the oracles."""


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("mlx", "mlx-lm", "mlx-vlm", "numpy", "tqbatch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


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
