"""``tqbatch bench`` end to end (subprocess) and its table, on the small geometry."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tqbatch.workbench import bench, bench_report


def _tqbatch(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"import sys; {prelude}from tqbatch.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600
    )


def test_bench_prints_a_markdown_row_per_op_and_writes_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "ops.png"
    done = _tqbatch("bench", "--ops", "trim", "filter", "--rounds", "1", "--plot", str(png))
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| op | context | bits |")
    ops = [line.split("|")[1].strip() for line in table[2:]]
    # The small set is one geometry: each chosen op, then the B=1 overhead step.
    assert ops == ["trim", "filter", "decode-overhead (B=1)"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_matplotlib_says_how_to_get_it(tmp_path):
    # None in sys.modules makes `import matplotlib` raise ImportError.
    done = _tqbatch(
        "bench", "--plot", str(tmp_path / "x.png"), prelude="sys.modules['matplotlib'] = None; "
    )
    assert done.returncode == 2
    assert "tqbatch[plot]" in done.stderr
    assert not (tmp_path / "x.png").exists()


def test_bench_rejects_an_unloadable_impl():
    done = _tqbatch("bench", "--impl", "no_such_module:Cache")
    assert done.returncode == 2
    assert "no_such_module" in done.stderr


def _row(op, context, target, reference):
    g = bench.Geometry(8, 8, 128, context, 4)
    return bench.Row(op, g, target, reference, "BatchKVCache")


def test_goals_follow_the_issue():
    assert bench_report.goal(_row("prepare+finalize", 512, 1, 1)) == 1.0
    assert bench_report.goal(_row("filter", 4096, 1, 1)) == 0.5
    assert bench_report.goal(_row("filter", 512, 1, 1)) is None  # the 0.5x goal is set at 4096 only
    assert bench_report.goal(_row("decode-overhead (B=1)", 512, 1, 1)) == 1.05
    assert bench_report.goal(_row("decode", 4096, 1, 1)) is None


def test_markdown_table_reports_ratio_and_verdict():
    table = bench_report.markdown_table(
        [_row("merge", 4096, 0.002, 0.010), _row("extend", 4096, 3, 2)]
    )
    lines = table.splitlines()
    assert lines[2] == "| merge | 4096 | 4 | 2.00 | BatchKVCache | 10.00 | 0.20 | <= 0.5 met |"
    assert lines[3].endswith("| 1.50 | <= 0.5 missed |")


def test_bench_refuses_a_target_without_merge():
    # mlx-vlm's own batch cache has no merge(), from which every workload starts.
    done = _tqbatch("bench", "--impl", "mlx_vlm.turboquant:BatchTurboQuantKVCache")
    assert done.returncode == 2
    assert "has no merge" in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_skips_ops_the_target_lacks(tmp_path):
    (tmp_path / "nofilter.py").write_text(
        "from tqbatch import BatchTurboQuantKVCache\n"
        "class NoFilter(BatchTurboQuantKVCache):\n"
        "    filter = None\n"
    )
    done = _tqbatch(
        "bench",
        "--impl",
        "nofilter:NoFilter",
        "--ops",
        "filter",
        "trim",
        "--rounds",
        "1",
        prelude=f"sys.path.insert(0, {str(tmp_path)!r}); ",
    )
    assert done.returncode == 0, done.stderr
    assert "lacks filter: not timed" in done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    ops = [line.split("|")[1].strip() for line in table[2:]]  # past header and rule
    assert ops == ["trim", "decode-overhead (B=1)"]


def test_bench_decode_prints_the_decode_table():
    done = _tqbatch("bench", "--decode", "--rounds", "1")
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| B | context | bits | target (ms) | float16 (ms) |")
    # The small grid: B = 8, 512 tokens, 4 bits; reads 8*8*512 slots * 2 sides * 66 B.
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    assert cells[:3] == ["8", "512", "4"]
    assert cells[6:8] == ["4.3", "16.8"]


@pytest.mark.parametrize("kernel", [False, True], ids=["decode", "decode-kernel"])
def test_bench_decode_plots_the_ratio_to_float16(tmp_path, kernel):
    pytest.importorskip("matplotlib")
    png = tmp_path / "decode.png"
    # On CUDA --kernel times the whole grid (B = 32 at 32k tokens runs out of memory beside
    # other test workers): one batch size and bit width of it.
    flags = ["--kernel", "--batch", "1", "--bits", "4"] if kernel else []
    done = _tqbatch("bench", "--decode", *flags, "--rounds", "1", "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert f"plot written to {png}" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_plot_draws_each_batch_and_path(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    drawn = []
    real = plt.Axes.plot
    monkeypatch.setattr(
        plt.Axes, "plot", lambda ax, *a, **k: drawn.append(k.get("label")) or real(ax, *a, **k)
    )
    rows = [
        bench.KernelRow(bench.Geometry(b, 8, 128, t, 4, 32), 0.001 * t / 1024, 0.002, 0.001)
        for b in (1, 8)
        for t in (1024, 4096)
    ]
    bench_report.plot_decode(rows, str(tmp_path / "k.png"))
    assert drawn == ["fused, B=1", "vectorized, B=1", "fused, B=8", "vectorized, B=8"]


def test_decode_goals_and_bytes_follow_the_issue():
    def row(batch, context, bits):
        g = bench.Geometry(batch, 8, 128, context, bits, query_heads=32)
        return bench.Row("decode", g, 1, 1, "BatchKVCache")

    assert bench_report.decode_goal(row(8, 4096, 4), "cpu") == 1.1
    assert bench_report.decode_goal(row(8, 4096, 8), "cpu") == 1.5
    assert bench_report.decode_goal(row(8, 4096, 8), "gpu") == 2.0
    assert bench_report.decode_goal(row(1, 4096, 4), "cpu") is None
    # 66 B per token-head and side at 4 bits (64 B of codes + a float16 norm), 256 B in float16.
    g = row(1, 1, 4).geometry
    assert bench_report.packed_bytes_read(g) == 8 * 2 * 66
    assert bench_report.float16_bytes_read(g) == 8 * 2 * 256
