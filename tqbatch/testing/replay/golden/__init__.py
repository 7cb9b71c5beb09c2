"""The golden scenarios, shipped with tqbatch: one ``NAME.json`` + ``NAME.npz`` pair per pinned bug.

Package data, so that a cache's owner replays them from an installed tqbatch
(``tqbatch replay`` with no path, ``pytest --pyargs tqbatch.conformance``).
The format and the list of scenarios: tests/golden/README.md in tqbatch's
repository; ``tqbatch.testing.replay`` reads them (``scenario``) and replays them (``replayer``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DIRECTORY", "paths"]

DIRECTORY = Path(__file__).resolve().parent


def paths() -> list[Path]:
    """The shipped scenario files (``NAME.json``), in name order.

    Listed without importing mlx (``tqbatch.testing.replay.scenario`` does): pytest
    collects the plugin's tests before MLX's precision may be chosen.
    """
    return sorted(DIRECTORY.glob("*.json"))
