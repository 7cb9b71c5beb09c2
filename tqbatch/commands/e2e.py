"""``tqbatch e2e``: run :mod:`tqbatch.workbench.e2e`'s scenario; print verdict and model report.

With ``--family mlx-lm:NAME`` it runs instead one of mlx-lm's own model classes
through mlx-lm's real ``BatchGenerator`` (the model matrix's
``batch_generator`` scenario) and prints each request's verdict.

Exit codes (``tqbatch.exitcodes``): 0 every request checked and matching; 1
a failure (a scenario that stops early is one, so a run never checks
nothing); 2 a usage error or a target that does not load; 3 the backend
failed its check.
"""

from __future__ import annotations

import argparse
import textwrap

import tqbatch.workbench.e2e
from tqbatch.commands import add_impl_argument
from tqbatch.exitcodes import ExitCode
from tqbatch.testing.backend import describe_line
from tqbatch.workbench import lm_families
from tqbatch.workbench.e2e import REQUESTS, ModelSpec, ScenarioResult, run_scenario

# What the model-level numbers mean, measured with tqbatch's cache on this
# project's CPU (float32) over weight seeds 0-9: see tqbatch.workbench.e2e's docstring.
MODEL_LEVEL_NOTE = (
    "expect max |dlogit| ~1e-6..1e-5 where no code or norm differs from the run alone, "
    "~1e-4 where one float16 token norm differs and up to ~1e-1 where a 4-bit code does; "
    "such differences come from the batched forward's float32 rounding (other K/V bits "
    "enter the cache), not from the cache, whose verdict above is fed the batch's own K/V"
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "e2e",
        help="continuous batching through a real mlx-vlm language model, checked per request",
        # What the scenario does: the second paragraph of the module it runs.
        description=tqbatch.workbench.e2e.__doc__.split("\n\n")[1],
    )
    parser.add_argument("--bits", type=float, default=4.0, help="TurboQuant bits (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="TurboQuant codec seed")
    parser.add_argument("--model-seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt tokens")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (last is dense)")
    add_impl_argument(parser, "batch cache under test")
    parser.add_argument(
        "--family",
        choices=lm_families.FAMILIES,
        metavar="FAMILY",
        help="run this mlx-lm model class through mlx-lm's BatchGenerator instead "
        f"(one of {', '.join(lm_families.FAMILIES)}); --bits, --seed and the model "
        "options do not apply",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqbatch.testing.target import impl_spec, load_impl

    impl = load_impl(args.impl)
    if args.family is not None:
        return run_family(args.family, impl, args.backend)
    if args.layers < 2:
        print("e2e needs at least 2 layers: TurboQuant ones and the dense last one")
        return ExitCode.USAGE
    spec = ModelSpec(num_layers=args.layers, seed=args.model_seed)
    print(spec.describe())
    print(f"backend: {describe_line(args.backend)}")
    print(
        f"cache: {impl_spec(impl)}, {args.bits:g} bits, seed {args.seed}; "
        f"layer {spec.num_layers - 1} dense (mlx-lm BatchKVCache)"
    )
    result = run_scenario(
        spec,
        bits=args.bits,
        seed=args.seed,
        prompt_seed=args.prompt_seed,
        batch_cache_class=impl,
    )
    print()
    for event in result.events:
        print(f"  {event}")
    print()
    _print_verdict(result)
    print()
    _print_model_level(result)
    print()
    print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in result.seconds.items()))
    failures = result.failures()
    for failure in failures:
        print(f"FAILED: {failure}")
    if not failures:
        print("OK: every request's rows, attention and extracted caches match its references")
    return ExitCode.DEFECT if failures else ExitCode.OK


def _print_verdict(result: ScenarioResult):
    print(
        "cache oracle (the verdict): every quantized layer's batch rows, attention outputs and "
        "extracted caches\nvs single-request TurboQuantKVCache references fed the same K/V; "
        "excess = max |got - want| / tolerance (passes <= 1)"
    )
    print(f"  {'request':<8}{'content':>18}{'attention':>18}{'extract':>18}")
    print(f"  {'':<8}" + f"{'checks':>9}{'excess':>9}" * 3)
    for uid, _, _ in REQUESTS:
        c = result.checks.get(uid)
        if c is None:
            print(f"  {uid:<8}{'not checked':>18}")
            continue
        cells = (
            (c.content, c.worst_content),
            (c.attention, c.worst_attention),
            (c.extract, c.worst_extract),
        )
        print(f"  {uid:<8}" + "".join(f"{n:>9}{worst:>9.2g}" for n, worst in cells))
    print(
        f"  {result.forwards} forwards, {result.mask_checks} (layer, forward) "
        f"mask widths checked, {result.trimmed} slots rolled back, "
        f"{result.admitted} rounding choices admitted"
    )


def _print_model_level(result: ScenarioResult):
    print(
        "model level (a report, not a verdict): teacher-forced batched run vs the request run alone"
    )
    if not result.alone:
        print("  (not available: the scenario stopped early)")
        return
    print(
        f"  {'request':<8}{'top-1':>8}{'max |dlogit|':>14}{'resume':>10}"
        f"{'codes differing':>18}{'norms differing':>18}"
    )
    for uid, _, _ in REQUESTS:
        a = result.alone.get(uid)
        if a is None:
            continue
        print(
            f"  {uid:<8}{f'{a.top1}/{a.steps}':>8}{a.max_logit_gap:>14.2e}{a.resume_gap:>10.2e}"
            f"{f'{a.flipped_codes}/{a.codes}':>18}{f'{a.flipped_norms}/{a.norms}':>18}"
        )
    print(
        f"  top-1 agreement {result.top1_rate():.1%}, codes differing "
        f"{result.flip_fraction('codes'):.2e}, norms differing {result.flip_fraction('norms'):.2e}"
    )
    print(
        textwrap.fill(
            f"({MODEL_LEVEL_NOTE})", width=100, initial_indent="  ", subsequent_indent="   "
        )
    )


def run_family(family: str, impl, backend) -> int:
    """``family`` through mlx-lm's ``BatchGenerator`` under the matrix's cache oracle."""
    from tqbatch.testing.target import impl_spec
    from tqbatch.workbench import batch_generator_scenario, model_matrix

    target = model_matrix.Target(impl_spec(impl), impl)
    print(f"model: mlx-lm {family.removeprefix(lm_families.PREFIX)}, random weights")
    print(f"backend: {describe_line(backend)}")
    print(
        f"cache: {target.name}, {model_matrix.BITS:g} bits, seed {model_matrix.SEED}, "
        "on the layers mlx-lm's cache rule quantizes (tqbatch.mlx_lm.make_prompt_cache)"
    )
    print(
        "serving loop: mlx-lm's BatchGenerator (insert, prefill, extend, remove mid-flight, "
        f"finish, reinsert its caches), tokens per request {batch_generator_scenario.MAX_TOKENS}"
    )
    cell = model_matrix.run_cell(family, "batch_generator", target)
    print()
    print(
        "cache oracle (the verdict): every quantized layer's batch rows, attention outputs and "
        "handed-back caches\nvs single-request TurboQuantKVCache references fed the same K/V; "
        "excess = max |got - want| / tolerance (passes <= 1); every token must be the "
        "request's alone token"
    )
    print(f"  {'request':<8}{'checks':>9}{'excess':>9}{'tokens':>8}{'max |dlogprob|':>16}")
    for r in cell.requests:
        gap = "-" if r.gap is None else f"{r.gap:.2e}"
        print(f"  {r.uid:<8}{r.checks:>9}{r.worst:>9.2g}{r.tokens:>8}{gap:>16}")
    print(
        f"  {cell.checks} checks, {cell.admitted} rounding choices admitted, {cell.seconds:.2f} s"
    )
    if cell.status in ("PASS", "NONDET"):
        # NONDET: the oracle passed; only a logit gap two runs did not reproduce.
        print(f"OK: {cell.short()}")
        return ExitCode.OK
    print(f"FAILED: {cell.short()}")
    return ExitCode.DEFECT
