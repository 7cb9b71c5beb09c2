"""The same survey campaigns with Hypothesis's line-coverage tracing on and off, compared.

``run_campaign`` turns the tracing off (``hypothesis_internals.no_coverage_tracing``);
this runs each target's campaign (``ci`` profile, 20 examples, survey) both
ways and prints the seconds of each and whether the outcomes are the same:
examples, op counts, op-pair counts, shrink runs, and every failure's
identity and shrunk op sequence::

    python scripts/tracing_equivalence.py [TARGET ...]

TARGET is ``tqbatch``, ``mlx-vlm`` or a mutant's name (default: all).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

from tqbatch.testing.mutants import MUTANTS
from tqbatch.testing.search import campaign, hypothesis_internals
from tqbatch.testing.target import load_impl


def outcome(result: campaign.CampaignResult) -> str:
    return json.dumps(result.outcome(), sort_keys=True, default=str)


def main(argv: list[str]) -> int:
    names = argv or ["tqbatch", "mlx-vlm", *sorted(MUTANTS)]
    untraced = hypothesis_internals.no_coverage_tracing
    same = 0
    for name in names:
        impl = MUTANTS[name] if name in MUTANTS else load_impl(name)
        seconds, outcomes = {}, {}
        for tracing in ("on", "off"):
            hypothesis_internals.no_coverage_tracing = (
                contextlib.nullcontext if tracing == "on" else untraced
            )
            start = time.monotonic()
            result = campaign.run_campaign(impl, examples=20, profile="ci", survey=True)
            seconds[tracing] = time.monotonic() - start
            outcomes[tracing] = outcome(result)
        hypothesis_internals.no_coverage_tracing = untraced
        equal = outcomes["on"] == outcomes["off"]
        same += equal
        print(
            f"{name}: {'same' if equal else 'DIFFERENT'}  "
            f"on {seconds['on']:.1f}s off {seconds['off']:.1f}s",
            flush=True,
        )
    print(f"{same}/{len(names)} identical")
    return 0 if same == len(names) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
