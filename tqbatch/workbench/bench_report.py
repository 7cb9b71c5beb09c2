"""What ``tqbatch bench`` prints and plots from ``bench``'s rows: markdown tables and PNGs.

Each table holds a row's times beside the goal set for its op and geometry
(``goal``, ``decode_goal``, ``kernel_goal``) and, for a decode step, the bytes
each side must read (``packed_bytes_read``, ``float16_bytes_read``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from tqbatch.workbench.bench import Geometry, KernelRow, Row


def kernel_goal(geometry: Geometry) -> float | None:
    """fused / float16 goals (set for an H200): B = 8, 4 bits: <= 1.0 at 4096 tokens and
    <= 0.6 at 32768; 8 bits: <= 1.2 at 4096. None elsewhere in the grid."""
    g = geometry
    if g.batch != 8:
        return None
    return {(4, 4096): 1.0, (4, 32768): 0.6, (8, 4096): 1.2}.get((g.bits, g.context))


def decode_kernel_header(bandwidth: float | None = None) -> str:
    """The two header lines of ``decode_kernel_table`` (with a packed-floor column given
    the device's copy ``bandwidth``)."""
    floor_head = " | packed floor (ms)" if bandwidth else ""
    return "\n".join(
        [
            "| B | context | bits | fused (ms) | vectorized (ms) | float16 (ms) | fused / float16 "
            "| vectorized / float16 | fused speed-up | read/step: packed (MB) | float16 (MB)"
            f"{floor_head} | goal |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            + ("---:|" if bandwidth else "")
            + "---|",
        ]
    )


def decode_kernel_line(r: KernelRow, bandwidth: float | None = None) -> str:
    """One geometry's line of ``decode_kernel_table``."""
    g = r.geometry
    want = kernel_goal(g)
    if r.fused is None:
        fused = ratio = speedup = "n/a"
        verdict = "" if want is None else f"<= {want:g} not measured"
    else:
        fused = _ms(r.fused)
        ratio = f"{r.fused / r.float16:.2f}"
        speedup = f"{r.vectorized / r.fused:.2f}x"
        verdict = ""
        if want is not None:
            verdict = f"<= {want:g} {'met' if r.fused / r.float16 <= want else 'missed'}"
    floor = f" | {_ms(packed_bytes_read(g) / bandwidth)}" if bandwidth else ""
    return (
        f"| {g.batch} | {g.context} | {g.bits} | {fused} | {_ms(r.vectorized)} | "
        f"{_ms(r.float16)} | {ratio} | {r.vectorized / r.float16:.2f} | {speedup} | "
        f"{packed_bytes_read(g) / 1e6:.1f} | {float16_bytes_read(g) / 1e6:.1f}{floor} | "
        f"{verdict} |"
    )


def decode_kernel_table(rows: Sequence[KernelRow], bandwidth: float | None = None) -> str:
    """The three decode paths as a markdown table of milliseconds and ratios to float16,
    with the bytes a step must read on each side and, given the device's copy
    ``bandwidth`` (bytes/s, read + written), the time those packed bytes take to read."""
    lines = [decode_kernel_header(bandwidth)]
    lines += [decode_kernel_line(r, bandwidth) for r in rows]
    return "\n".join(lines)


def packed_bytes_read(geometry: Geometry) -> float:
    """The floor of bytes a decode step reads from a TurboQuant cache: every slot's packed
    codes and float16 norm, keys and values (66 B per token and head at 4 bits, D = 128)."""
    g = geometry
    return g.batch * g.heads * g.context * 2 * (g.bits * g.head_dim / 8 + 2)


def float16_bytes_read(geometry: Geometry) -> float:
    """Bytes a float16 decode step reads: every slot's keys and values (256 B per token-head)."""
    g = geometry
    return g.batch * g.heads * g.context * 2 * g.head_dim * 2


def decode_goal(row: Row, backend: str | None = None) -> float | None:
    """The decode goal at B = 8 and 4096 tokens: on a CPU <= 1.1x float16 at 4 bits and
    <= 1.5x at 8 bits; on a GPU <= 2x. None elsewhere in the grid."""
    g = row.geometry
    if g.batch != 8 or g.context != 4096:
        return None
    backend = backend or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    if backend == "gpu":
        return 2.0
    return {4: 1.1, 8: 1.5}.get(g.bits)


def decode_table(rows: Sequence[Row]) -> str:
    """The decode comparison as a markdown table, with the bytes each side must read."""
    lines = [
        "| B | context | bits | target (ms) | float16 (ms) | ratio | read/step: packed (MB) "
        "| float16 (MB) | goal |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        g, want = r.geometry, decode_goal(r)
        verdict = "" if want is None else f"<= {want:g} {'met' if r.ratio <= want else 'missed'}"
        lines.append(
            f"| {g.batch} | {g.context} | {g.bits} | {_ms(r.target)} | {_ms(r.reference)} | "
            f"{r.ratio:.2f} | {packed_bytes_read(g) / 1e6:.1f} | {float16_bytes_read(g) / 1e6:.1f}"
            f" | {verdict} |"
        )
    return "\n".join(lines)


def goal(row: Row) -> float | None:
    """The issue's target ratio for ``row``, or None where it sets none.

    finalize <= 1x BatchKVCache's; filter, extend, merge <= 0.5x at 4096
    tokens; a decode step's batching overhead <= 5 % over the parent's work.
    """
    if row.op == "prepare+finalize":
        return 1.0
    if row.op in ("filter", "extend", "merge") and row.geometry.context >= 4096:
        return 0.5
    if row.op.startswith("decode-overhead"):
        return 1.05
    return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def markdown_table(rows: Sequence[Row]) -> str:
    """The comparison as a markdown table (times in milliseconds)."""
    lines = [
        "| op | context | bits | target (ms) | reference | reference (ms) | ratio | goal |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        g = goal(r)
        verdict = "" if g is None else f"<= {g:g} {'met' if r.ratio <= g else 'missed'}"
        lines.append(
            f"| {r.op} | {r.geometry.context} | {r.geometry.bits} | {_ms(r.target)} | "
            f"{r.reference_name} | {_ms(r.reference)} | {r.ratio:.2f} | {verdict} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- plot


def require_matplotlib():
    """matplotlib's pyplot on a file-only backend, or an ImportError saying how to get it."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'tqbatch[plot]'") from err
    matplotlib.use("Agg")  # no display: we only write files
    import matplotlib.pyplot as plt

    return plt


def plot(rows: Sequence[Row], path: str) -> None:
    """Write a PNG of each op's cost against context length, target and reference,
    one panel per bit width (log-log: contexts and costs span decades)."""
    plt = require_matplotlib()
    bit_widths = sorted({r.geometry.bits for r in rows})
    fig, axes = plt.subplots(
        1, len(bit_widths), figsize=(6 * len(bit_widths), 4.5), squeeze=False, sharey=True
    )
    for ax, bits in zip(axes[0], bit_widths):
        ops = list(dict.fromkeys(r.op for r in rows if r.geometry.bits == bits))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, op in enumerate(ops):
            mine = sorted(
                (r for r in rows if r.op == op and r.geometry.bits == bits),
                key=lambda r: r.geometry.context,
            )
            contexts = [r.geometry.context for r in mine]
            color = colors[i % len(colors)]
            ax.plot(contexts, [r.target * 1e3 for r in mine], "o-", color=color, label=op)
            ax.plot(contexts, [r.reference * 1e3 for r in mine], "s--", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"{bits}-bit target (solid) vs reference (dashed)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time per op (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize="small")
    fig.tight_layout(rect=(0, 0.12, 1, 1))  # leave the bottom strip to the legend
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_decode(rows: Sequence[Row | KernelRow], path: str) -> None:
    """Write a PNG of a decode step's time over float16 ``BatchKVCache``'s against context,
    one panel per bit width, one colour per batch size: the fused kernel solid and the
    vectorized path dashed (``--kernel``), or the target solid (plain ``--decode``)."""
    plt = require_matplotlib()
    bit_widths = sorted({r.geometry.bits for r in rows})
    fig, axes = plt.subplots(
        1, len(bit_widths), figsize=(6 * len(bit_widths), 4.5), squeeze=False, sharey=True
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, bits in zip(axes[0], bit_widths):
        batches = sorted({r.geometry.batch for r in rows if r.geometry.bits == bits})
        for i, batch in enumerate(batches):
            mine = sorted(
                (r for r in rows if r.geometry.bits == bits and r.geometry.batch == batch),
                key=lambda r: r.geometry.context,
            )
            contexts = [r.geometry.context for r in mine]
            color = colors[i % len(colors)]
            if isinstance(mine[0], KernelRow):
                if all(r.fused is not None for r in mine):
                    ratios = [r.fused / r.float16 for r in mine]
                    ax.plot(contexts, ratios, "o-", color=color, label=f"fused, B={batch}")
                ratios = [r.vectorized / r.float16 for r in mine]
                ax.plot(
                    contexts, ratios, "s--", color=color, alpha=0.6, label=f"vectorized, B={batch}"
                )
            else:
                ratios = [r.ratio for r in mine]
                ax.plot(contexts, ratios, "o-", color=color, label=f"B={batch}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"{bits}-bit decode step / float16 BatchKVCache")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time ratio to float16 (below 1: faster)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize="small")
    fig.tight_layout(rect=(0, 0.16, 1, 1))  # leave the bottom strip to the legend
    fig.savefig(path, dpi=120)
    plt.close(fig)
