"""Fixtures for the perf suite: one cached Workload per geometry.

The parameter set is chosen at collection time: the small one in the default
run, the issue's full grid with ``TQBATCH_PERF=full`` (the nox ``perf``
session). The target is ``--impl`` / ``$TQBATCH_IMPL`` (root conftest).
"""

from __future__ import annotations

import pytest

from tqbatch.workbench import bench

PARAMETERS = bench.selected_parameter_set()


@pytest.fixture(scope="session")
def workloads():
    """geometry -> Workload; pools (random K/V, packed states) are built once per session."""
    cache: dict[bench.Geometry, bench.Workload] = {}
    impl = bench.load_impl()

    def get(geometry: bench.Geometry) -> bench.Workload:
        if geometry not in cache:
            cache[geometry] = bench.Workload(geometry, impl=impl)
        return cache[geometry]

    return get


@pytest.fixture
def measure(benchmark):
    """Time a :class:`tqbatch.workbench.bench.Case` with pytest-benchmark, grouped with its peer."""

    def run(case: bench.Case, rounds: int = PARAMETERS.rounds):
        _run_case(benchmark, case, rounds)

    return run


def _run_case(benchmark, case: bench.Case, rounds: int):
    # Fresh setup each round: every op mutates its cache.
    benchmark.group = f"{case.op} {case.geometry.label}"
    benchmark.extra_info.update(op=case.op, side=case.side, geometry=case.geometry.label)
    # One warm-up round: MLX compiles kernels and allocates on first use.
    benchmark.pedantic(
        case.run, setup=case.pedantic_setup, rounds=rounds, iterations=1, warmup_rounds=1
    )
