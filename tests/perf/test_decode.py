"""A decode step as models take it (32 query heads over 8 KV heads), beside float16.

B 1 and 8, contexts 512, 4096 and 16384, bits 4 and 8 under
``TQBATCH_PERF=full`` (nox ``perf``); B = 8, 512 tokens, 4 bits by default.
Each group holds the target and mlx-lm's ``BatchKVCache`` + SDPA on the same
geometry; ``tqbatch bench --decode --full`` prints the ratios with the bytes
each side must read. Measured, never asserted.
"""

from __future__ import annotations

import pytest

from tqbatch.workbench import bench

GRID = bench.selected_decode_grid()


@pytest.mark.parametrize("side", bench.SIDES)
@pytest.mark.parametrize("geometry", GRID.geometries(), ids=lambda g: g.label)
def test_decode_step(measure, workloads, geometry, side):
    measure(workloads(geometry).case("decode", side), rounds=GRID.rounds)
