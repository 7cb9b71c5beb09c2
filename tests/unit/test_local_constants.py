"""A campaign draws the same examples whatever local code the process has imported.

Hypothesis mixes constants into its draws, some from the literals of every
module it counts as local: a cache owner's package, say. The campaign
empties that pool (``hypothesis_internals.no_local_constants``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys

from tqbatch import BatchTurboQuantKVCache
from tqbatch.testing import world
from tqbatch.testing.search import campaign, hypothesis_internals

# Literals an owner's module might hold, inside the range of the machine's
# seed draws, and found in no module of tqbatch (else already in the pool);
# each test its own, as Hypothesis's pool only grows.
LIMITS = {"pinned": [6151, 12289, 24593, 49157], "unpinned": [7919, 15401, 31337, 52361]}


def _ops(monkeypatch) -> list[str]:
    """Every op the campaign applies, in order."""
    ops: list[str] = []
    apply = world.World.apply

    def recorded(self, op):
        ops.append(json.dumps(op, sort_keys=True))
        return apply(self, op)

    with monkeypatch.context() as patched:
        patched.setattr(world.World, "apply", recorded)
        campaign.run_campaign(BatchTurboQuantKVCache, examples=10, profile="ci", seed=3)
    return ops


def _with_owner_module(monkeypatch, tmp_path, limits: list[int]) -> list[str]:
    """The campaign's ops once a local module with literals of its own is imported."""
    name = f"owner_limits_{tmp_path.name}"  # a module new to this process
    (tmp_path / f"{name}.py").write_text(f"LIMITS = {limits!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(name)
    try:
        return _ops(monkeypatch)
    finally:
        del sys.modules[name]  # later tests' pools do not hold it


def test_an_imported_local_module_changes_nothing(monkeypatch, tmp_path):
    before = _ops(monkeypatch)
    assert _with_owner_module(monkeypatch, tmp_path, LIMITS["pinned"]) == before


def test_without_the_empty_pool_the_owner_module_changes_examples(monkeypatch, tmp_path):
    """What the test above guards against: the same campaign with Hypothesis's pool."""
    monkeypatch.setattr(hypothesis_internals, "no_local_constants", contextlib.nullcontext)
    before = _ops(monkeypatch)
    assert _with_owner_module(monkeypatch, tmp_path, LIMITS["unpinned"]) != before
