"""``tqbatch e2e``: run :mod:`tqbatch.e2e`'s scenario and print its per-request report."""

from __future__ import annotations

import argparse

import tqbatch.e2e
from tqbatch.commands import add_impl_argument
from tqbatch.e2e import LOGITS_ATOL, REQUESTS, ModelSpec, run_scenario


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "e2e",
        help="continuous batching through a real mlx-vlm language model, checked per request",
        # What the scenario does: the second paragraph of the module it runs.
        description=tqbatch.e2e.__doc__.split("\n\n")[1],
    )
    parser.add_argument("--bits", type=float, default=4.0, help="TurboQuant bits (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="TurboQuant codec seed")
    parser.add_argument("--model-seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt tokens")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (last is dense)")
    add_impl_argument(parser, "batch cache under test")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqbatch.testing.impl import load_impl

    impl = load_impl(args.impl)
    if args.layers < 2:
        print("e2e needs at least 2 layers: TurboQuant ones and the dense last one")
        return 2
    spec = ModelSpec(num_layers=args.layers, seed=args.model_seed)
    print(spec.describe())
    print(
        f"cache: {impl.__module__}.{impl.__qualname__}, {args.bits:g} bits, seed {args.seed}; "
        f"layer {spec.num_layers - 1} dense (mlx-lm BatchKVCache)"
    )
    try:
        result = run_scenario(
            spec,
            bits=args.bits,
            seed=args.seed,
            prompt_seed=args.prompt_seed,
            batch_cache_class=impl,
        )
    except Exception as exc:  # a broken cache may crash inside the model
        print(f"FAILED: the scenario raised {type(exc).__name__}: {exc}")
        return 1
    print()
    for event in result.events:
        print(f"  {event}")
    print()
    print(
        f"  {'request':<8}{'prompt':>7}{'tokens':>7}{'max |dlogit|':>14}{'resume':>10}"
        f"  tokens  codes differing per layer"
    )
    for uid, n_prompt, n_new in REQUESTS:
        print(
            f"  {uid:<8}{n_prompt:>7}{n_new:>7}{result.max_logit_diff[uid]:>14.2e}"
            f"{result.resume_diff[uid]:>10.2e}  {'same' if result.tokens_match[uid] else 'DIFF':<6}"
            f"  {result.code_mismatches[uid]}"
        )
    print()
    print(
        f"  worst logit difference {result.worst_diff:.2e} (tolerance {LOGITS_ATOL:g}); "
        f"smallest reference top-2 gap {result.min_reference_margin:.3g}"
    )
    print(
        f"  {result.forwards} batched forwards, {result.mask_checks} (layer, forward) "
        f"mask widths checked, {result.trimmed} slots rolled back"
    )
    print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in result.seconds.items()))
    failures = result.failures()
    for failure in failures:
        print(f"FAILED: {failure}")
    if not failures:
        print("OK: every request matches its single-request run")
    return 1 if failures else 0
