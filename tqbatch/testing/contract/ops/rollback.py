"""``rollback``: each row drops its own number of last tokens, as a speculative server commits.

After a verify block, row ``b`` keeps the drafts it accepted and drops the
rest: ``n[b]`` tokens. mlx-vlm commits a ragged accept this way
(``mlx_vlm.speculative.cache_state``): ``trim`` every row by the fewest
dropped, then ``prepare(right_padding=n - min(n))`` and ``finalize()``, which
rolls each row's extra tail out into left padding. Every cache with
``trim``, ``prepare`` and ``finalize`` gets it from these three calls; the
checks after the op hold each row to its own request's tokens.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tqbatch.testing.contract import strategies as tqs
from tqbatch.testing.contract.ops.declaration import Op, Rule, out_of_domain, require_row_counts


def _validate(world, op):
    require_row_counts(op, "n", world.numpy_model.batch_size)
    if world.numpy_model.right_padding is not None:
        raise out_of_domain(op, "right padding is pending; finalize the prefill first")


def _split(op) -> tuple[int, list[int]]:
    """(slots every row drops, each row's further tokens rolled into left padding)."""
    n = [int(x) for x in op["n"]]
    common = min(n)
    return common, [x - common for x in n]


def _target(world, op):
    common, tail = _split(op)
    trimmed = world.target.trim(common)
    if any(tail):
        world.target.prepare(right_padding=tail)
        world.target.finalize()
    return trimmed


def _oracles(world, op, trimmed):
    common, tail = _split(op)
    dense_n = world.dense.trim(common)
    model_n, dropped = world.numpy_model.trim(common)
    world.trim_references(dropped)
    if any(tail):
        world.dense.prepare(None, tail)
        world.dense.finalize()
        world.numpy_model.prepare(None, tail)
        world.trim_references(world.numpy_model.finalize())
    if not isinstance(trimmed, (int, np.integer)) or int(trimmed) != model_n:
        world.report(
            "trim_count",
            op,
            f"trim({common}) returned {trimmed!r}, expected {model_n} (BatchKVCache: {dense_n})",
        )
    return op["n"]


def _ragged_rollback(machine, data):
    """A verify block of drafts, then each row rolls back its own rejected tail."""
    block = data.draw(st.integers(1, 4), label="block")
    rows = machine.numpy_model.offsets
    # A row drops at most the tokens it holds once the block is written.
    n = [
        data.draw(st.integers(0, max(0, min(block, offset + block))), label=f"n[{b}]")
        for b, offset in enumerate(rows)
    ]
    return [
        {"op": "update", "tokens": block, "kv_seed": data.draw(tqs.seeds, label="kv_seed")},
        {"op": "rollback", "n": n},
    ]


OP = Op(
    name="rollback",
    fields="`n: [int]`",
    meaning="row `b` drops its last `n[b]` tokens, as a speculative server commits a ragged "
    "accept: `trim(min(n))`, then `prepare(right_padding=n - min(n))` and `finalize()`",
    target=_target,
    oracles=_oracles,
    validate=_validate,
    needs=("trim", "prepare", "finalize"),
    rules=(
        Rule(
            "ragged_rollback",
            _ragged_rollback,
            lambda machine: (
                all(machine.has(c) for c in ("trim", "prepare", "finalize"))
                and machine.numpy_model.right_padding is None
            ),
            doc=_ragged_rollback.__doc__,
        ),
    ),
    notes=(
        "`rollback`: `n` has one count per row, each at most the tokens the row holds; no "
        "right padding may be pending (a prefill is finalized first).",
    ),
)
