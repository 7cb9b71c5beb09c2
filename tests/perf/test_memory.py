"""Memory per token: the target against float16 and against the theoretical floor.

Reported (printed and recorded as test properties) and checked structurally:
at these head dims ``bits x D`` is a whole number of 32-bit words, so a cache
without overhead or dead columns holds exactly the floor (packed indices plus
one float16 norm per head, side and slot) for every row and written slot.
"""

from __future__ import annotations

import pytest

from tqbatch.workbench import bench

GEOMETRIES = bench.selected_parameter_set().geometries()


def _report(record_property, stage, report: bench.MemoryReport):
    g = report.geometry
    line = (
        f"{g.label} {stage}: {report.target:.0f} B/slot "
        f"(float16 {report.float16:.0f}, x{report.vs_float16:.3f}; "
        f"floor {report.minimum:.0f}, x{report.vs_minimum:.3f})"
    )
    print(line)
    record_property(f"memory {stage}", line)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g.label)
def test_bytes_per_token_after_merge_and_compacting_filter(workloads, geometry, record_property):
    assert geometry.bits * geometry.head_dim % 32 == 0, "the exact-floor check needs whole words"
    w = workloads(geometry)
    cache = w.merged("target")
    baseline = w.merged("baseline")

    merged = bench.memory_report(cache, geometry)
    _report(record_property, "merged", merged)
    assert cache.size() == max(w.lengths)
    assert merged.target == merged.minimum
    # The float16 baseline on the same rows, as the reference point of the report.
    assert bench.memory_report(baseline, geometry).target == merged.float16

    cache.filter(w.kept_rows)
    bench.eval_cache(cache)
    filtered = bench.memory_report(cache, geometry)
    _report(record_property, "after filter", filtered)
    # The unpadded row 0 left: the survivors' shared leading padding is dead
    # and must be gone, so the written end is the longest survivor...
    assert cache.size() == max(w.lengths[i] for i in w.kept_rows)
    # ...and the allocated capacity is that end: nothing beyond the floor.
    assert filtered.target == filtered.minimum
