"""``tqbatch models --grid``: the statuses as a family x scenario grid."""

from __future__ import annotations

from types import SimpleNamespace

from tqbatch.commands.models import grid


def _cell(family, scenario, target, status):
    return SimpleNamespace(family=family, scenario=scenario, target=target, status=status)


def test_a_row_per_family_a_column_per_scenario_each_target_in_order():
    targets = [SimpleNamespace(name="tqbatch"), SimpleNamespace(name="BatchKVCache")]
    cells = [
        _cell("mlx-lm:llama", "prefill_decode", "tqbatch", "PASS"),
        _cell("mlx-lm:llama", "prefill_decode", "BatchKVCache", "PASS"),
        _cell("mlx-lm:llama", "batch_generator", "tqbatch", "FAIL"),
        _cell("mlx-lm:llama", "batch_generator", "BatchKVCache", "PASS"),
        _cell("qwen2", "prefill_decode", "tqbatch", "N/A"),
        _cell("qwen2", "prefill_decode", "BatchKVCache", "N/A"),
    ]
    assert grid(cells, targets).splitlines() == [
        "| family | prefill_decode | batch_generator |",
        "|---|---|---|",
        "| mlx-lm:llama | PASS / PASS | FAIL / PASS |",
        "| qwen2 | N/A / N/A |  |",  # no batch_generator scenario for an mlx-vlm family
    ]
