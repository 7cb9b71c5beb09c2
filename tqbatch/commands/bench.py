"""``tqbatch bench``: time the target's ops beside mlx-lm's BatchKVCache, print ratios.

A measurement, not a verdict: it never exits 1. Exit codes
(``tqbatch.exitcodes``): 0 timed; 2 a usage error (e.g. ``--plot`` without
matplotlib), a target that does not load or one without ``merge`` (every
workload starts from it); 3 the backend failed its check; 5 nothing was
timed: the target lacks every op asked for. Under GitHub Actions the table is
also appended to ``$GITHUB_STEP_SUMMARY``.
"""

from __future__ import annotations

import dataclasses
import sys

from tqbatch.commands import add_impl_argument, step_summary
from tqbatch.exitcodes import ExitCode
from tqbatch.testing.backend import describe_line
from tqbatch.testing.target import capabilities, impl_spec
from tqbatch.workbench import bench, bench_report

# Capabilities (tqbatch.testing.target.capabilities) each timed op needs besides merge.
_NEEDS = {
    "merge": (),
    "extend": ("extend",),
    "filter": ("filter",),
    "extract": ("extract",),
    "prepare+finalize": ("prepare", "finalize"),
    "trim": ("trim",),
    "decode": (),
}
assert set(_NEEDS) == set(bench.OPS)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="compare op costs with mlx-lm's BatchKVCache (markdown table)",
        description=(
            "Time merge, extend, filter, extract, prepare+finalize, trim and a decode step "
            "of the target and of mlx-lm's BatchKVCache (float16) on the same geometry, "
            "plus the batching overhead of a B=1 decode step over mlx-vlm's "
            "TurboQuantKVCache, and print a markdown table of ratios from this one run."
        ),
    )
    add_impl_argument(parser)
    parser.add_argument(
        "--full",
        action="store_true",
        help="the full grid: B=8, H=8, D=128, bits 4 and 8, contexts 512 and 4096 "
        "(default: contexts 512, 4 bits)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per op and side (median)"
    )
    parser.add_argument(
        "--ops",
        nargs="+",
        choices=bench.OPS,
        default=list(bench.OPS),
        metavar="OP",
        help=f"ops to time (default: all of {', '.join(bench.OPS)})",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="only the decode step, as models take it (32 query heads over 8 KV heads, "
        "D=128), with the bytes each side must read; with --full: B 1 and 8, contexts "
        "512, 4096 and 16384, bits 4 and 8 (default: B=8, 512 tokens, 4 bits)",
    )
    parser.add_argument(
        "--kernel",
        action="store_true",
        help="with --decode: the decode step under the fused CUDA kernel, the vectorized "
        "path and float16 BatchKVCache, in one run, with the bytes a step reads (B 1, 8 and "
        "32, bits 4 and 8, contexts 1024 to 32768 in powers of two; without --full on a "
        "machine with no CUDA GPU: B=8, 512 tokens, 4 bits)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        metavar="B",
        help="with --decode: only these batch sizes of the grid (e.g. to split a long "
        "--kernel run in parts)",
    )
    parser.add_argument(
        "--bits",
        type=int,
        nargs="+",
        metavar="N",
        help="with --decode: only these bit widths of the grid",
    )
    parser.add_argument(
        "--plot",
        metavar="OUT.png",
        help="also plot op cost against context (with --decode: the ratio to float16)",
    )
    parser.set_defaults(func=run)


def _select(grid, args):
    """``grid`` cut to ``--batch`` and ``--bits`` (each kept as given where absent)."""
    if args.batch:
        grid = dataclasses.replace(grid, batches=tuple(args.batch))
    if args.bits:
        grid = dataclasses.replace(grid, bits=tuple(args.bits))
    return grid


def _decode_kernel(args, impl, name, progress) -> int:
    from tqbatch import _cuda_decode

    full = args.full or _cuda_decode.available()
    grid = bench.DECODE_KERNEL if full else bench.DECODE_KERNEL_SMALL
    grid = _select(grid, args)
    if args.rounds is not None:
        grid = dataclasses.replace(grid, rounds=args.rounds)
    # The floor a step's packed reads set, against this device's own copy rate.
    bandwidth = bench.copy_bandwidth() if _cuda_decode.available() else None
    print(f"backend: {describe_line(args.backend)}")
    print(
        f"target: {name}; median of {grid.rounds} rounds, paths interleaved; fused and "
        "vectorized: TQBATCH_DECODE_KERNEL; float16: mlx-lm's BatchKVCache + SDPA"
    )
    if bandwidth:
        print(
            f"device copy: {bandwidth / 1e12:.2f} TB/s (read + written); packed floor: the "
            "step's packed bytes at that rate; goals as set for an H200"
        )
    print()
    # Each line as soon as its geometry is measured: a run cut short keeps its numbers.
    print(bench_report.decode_kernel_header(bandwidth), flush=True)
    rows = bench.compare_decode_kernel(
        grid,
        impl=impl,
        progress=progress,
        on_row=lambda row: print(bench_report.decode_kernel_line(row, bandwidth), flush=True),
    )
    table = bench_report.decode_kernel_table(rows, bandwidth)
    step_summary(f"### tqbatch bench --decode --kernel\n\n{name}\n\n{table}")
    if args.plot:
        bench_report.plot_decode(rows, args.plot)
        print(f"\nplot written to {args.plot}")
    return ExitCode.OK


def run(args) -> int:
    if args.kernel and not args.decode:
        print("tqbatch bench: --kernel times the decode step; add --decode", file=sys.stderr)
        return ExitCode.USAGE
    if (args.batch or args.bits) and not args.decode:
        print(
            "tqbatch bench: --batch and --bits select the decode grid; add --decode",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    if args.plot:
        # Fail before minutes of timing, not after.
        try:
            bench_report.require_matplotlib()
        except ImportError as err:
            print(f"tqbatch bench --plot: {err}", file=sys.stderr)
            return ExitCode.USAGE
    impl = bench.load_impl(args.impl)  # a bad target: ImplSpecError, reported by tqbatch.cli
    caps = capabilities(impl)
    name = impl_spec(impl)
    if not caps.get("merge"):
        print(
            f"tqbatch bench: every workload starts from merge() of single-request caches; "
            f"{name} has no merge",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    runnable = [op for op in args.ops if all(caps.get(c) for c in _NEEDS[op])]
    skipped = [op for op in args.ops if op not in runnable]
    if skipped:
        print(f"tqbatch bench: {name} lacks {', '.join(skipped)}: not timed", file=sys.stderr)
    if not runnable and not args.decode:
        print("tqbatch bench: nothing was timed", file=sys.stderr)
        return ExitCode.NOTHING_CHECKED
    args.ops = runnable
    parameters = bench.FULL if args.full else bench.SMALL
    grid = bench.DECODE_FULL if args.full else bench.DECODE_SMALL
    if args.rounds is not None:
        if args.rounds < 1:
            print("tqbatch bench: --rounds must be at least 1", file=sys.stderr)
            return ExitCode.USAGE
        parameters = dataclasses.replace(parameters, rounds=args.rounds)
        grid = dataclasses.replace(grid, rounds=args.rounds)
    progress = lambda what: print(f"timing {what}", file=sys.stderr, flush=True)  # noqa: E731
    if args.decode and args.kernel:
        return _decode_kernel(args, impl, name, progress)
    if args.decode:
        grid = _select(grid, args)
        rows = bench.compare_decode(grid, impl=impl, progress=progress)
        print(f"backend: {describe_line(args.backend)}")
        print(
            f"target: {name}; median of {grid.rounds} rounds, sides alternating; "
            "float16: mlx-lm's BatchKVCache + SDPA"
        )
        print()
        print(bench_report.decode_table(rows))
        step_summary(f"### tqbatch bench --decode\n\n{name}\n\n{bench_report.decode_table(rows)}")
        if args.plot:
            bench_report.plot_decode(rows, args.plot)
            print(f"\nplot written to {args.plot}")
        return ExitCode.OK

    rows = bench.compare(
        parameters,
        impl=impl,
        ops=args.ops,
        progress=progress,
    )
    print(f"backend: {describe_line(args.backend)}")
    print(
        f"target: {impl_spec(impl)}; median of {parameters.rounds} rounds"
        f" ({bench.OVERHEAD_ROUNDS_FACTOR * parameters.rounds} for decode-overhead),"
        " sides alternating"
    )
    print()
    print(bench_report.markdown_table(rows))
    step_summary(f"### tqbatch bench\n\n{name}\n\n{bench_report.markdown_table(rows)}")
    if args.plot:
        bench_report.plot(rows, args.plot)
        print(f"\nplot written to {args.plot}")
    return ExitCode.OK
