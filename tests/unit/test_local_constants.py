"""A campaign draws the same examples whatever local code the process has imported.

Hypothesis mixes constants into its draws, some from the literals of every
module it counts as local: a cache owner's package, say. Campaigns and
``machine_test_case`` empty that pool (``hypothesis_internals.no_local_constants``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys

import pytest
from hypothesis import settings

from tqbatch import BatchTurboQuantKVCache
from tqbatch.testing import world
from tqbatch.testing.search import campaign, hypothesis_internals, stateful
from tqbatch.testing.search.profiles import PROFILES

# Literals an owner's module might hold, inside the range of the machine's
# seed draws, and found in no module of tqbatch (else already in the pool);
# each test its own, as Hypothesis's pool only grows.
LIMITS = {
    "pinned": [6151, 12289, 24593, 49157],
    "pinned, test case": [3259, 10007, 27011, 60013],
    "unpinned": [7919, 15401, 31337, 52361],
}


def _campaign():
    campaign.run_campaign(BatchTurboQuantKVCache, examples=10, profile="ci", seed=3)


def _machine_test_case():
    test = stateful.machine_test_case(BatchTurboQuantKVCache)
    test.settings = settings(PROFILES["ci"], max_examples=25, database=None)
    test("runTest").runTest()


def _ops(monkeypatch, run) -> list[str]:
    """Every op ``run()`` applies, in order."""
    ops: list[str] = []
    apply = world.World.apply

    def recorded(self, op):
        ops.append(json.dumps(op, sort_keys=True))
        return apply(self, op)

    with monkeypatch.context() as patched:
        patched.setattr(world.World, "apply", recorded)
        run()
    return ops


def _with_owner_module(monkeypatch, tmp_path, limits: list[int], run) -> list[str]:
    """``run()``'s ops once a local module with literals of its own is imported."""
    name = f"owner_limits_{tmp_path.name}"  # a module new to this process
    (tmp_path / f"{name}.py").write_text(f"LIMITS = {limits!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(name)
    try:
        return _ops(monkeypatch, run)
    finally:
        del sys.modules[name]  # later tests' pools do not hold it


@pytest.mark.parametrize("run", [_campaign, _machine_test_case], ids=["campaign", "test_case"])
def test_an_imported_local_module_changes_nothing(monkeypatch, tmp_path, run):
    before = _ops(monkeypatch, run)
    limits = LIMITS["pinned"] if run is _campaign else LIMITS["pinned, test case"]
    assert _with_owner_module(monkeypatch, tmp_path, limits, run) == before


def test_without_the_empty_pool_the_owner_module_changes_examples(monkeypatch, tmp_path):
    """What the test above guards against: the same campaign with Hypothesis's pool."""
    monkeypatch.setattr(hypothesis_internals, "no_local_constants", contextlib.nullcontext)
    before = _ops(monkeypatch, _campaign)
    assert _with_owner_module(monkeypatch, tmp_path, LIMITS["unpinned"], _campaign) != before
