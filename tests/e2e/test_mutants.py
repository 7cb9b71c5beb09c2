"""The scenario can fail: it kills the single-bug caches whose bug a server would hit.

The other mutants of ``tqbatch.testing.mutants`` break persistence, bad-input
handling, sliding windows, B = 1 padding or >256-slot capacity alignment,
which this scenario does not exercise (the unit and golden suites do).
"""

from __future__ import annotations

import pytest

from tqbatch.e2e import run_scenario
from tqbatch.serving import MaskGeometryError
from tqbatch.testing.mutants import MUTANTS

from .conftest import BITS, SEED, SPEC

KILLED_BY_E2E = [
    "FilterWithoutCompaction",
    "FilterKeepsOneDeadColumn",
    "FinalizeRequantizes",
    "TrimCrashesAtBatch",
    "SizeAsArray",
    "WriteAtCapacity",
    "HandWrittenMaskHidesLeftPadded",
    "ExtractDropsLastToken",
]


@pytest.mark.parametrize("name", KILLED_BY_E2E)
def test_scenario_kills(model, references, name):
    try:
        result = run_scenario(
            SPEC,
            bits=BITS,
            seed=SEED,
            model=model,
            references=references,
            batch_cache_class=MUTANTS[name],
        )
    except MaskGeometryError:
        return  # killed by the probe
    except (ValueError, TypeError, IndexError):
        return  # killed by a crash inside the model (shape or conversion error)
    assert result.failures(), f"{name} passed the end-to-end scenario"
