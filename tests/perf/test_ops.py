"""Op costs of the target beside mlx-lm's BatchKVCache on the same geometry.

Measured, never asserted: compare within a group (``--benchmark-group-by=group``
is pytest-benchmark's default) or run ``tqbatch bench`` for ratios.
"""

from __future__ import annotations

import pytest

from tqbatch.workbench import bench

GEOMETRIES = bench.selected_parameter_set().geometries()


@pytest.mark.parametrize("side", bench.SIDES)
@pytest.mark.parametrize("op", bench.OPS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g.label)
def test_op(measure, workloads, geometry, op, side):
    measure(workloads(geometry).case(op, side))


@pytest.mark.parametrize("side", ["target", "parent"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g.label)
def test_decode_batching_overhead(measure, workloads, geometry, side):
    """A decode step at B=1 against mlx-vlm's TurboQuantKVCache doing its own step."""
    target, parent = workloads(geometry).overhead_cases()
    measure(target if side == "target" else parent)
