"""What an op of the vocabulary declares, once (``Op``), and what the declarations add up
to (``Vocabulary``): read by the executor, the state machine, replay, the bad-input
survey and docs/ops.md."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tqbatch.testing.contract.checks import Check

__all__ = [
    "BadInput",
    "BatchShape",
    "Op",
    "Recorded",
    "Rule",
    "Vocabulary",
    "out_of_domain",
    "require_row_counts",
]


@dataclass(frozen=True)
class Rule:
    """A state-machine rule: ``draw(machine, data)`` returns the ops to run (``data``:
    Hypothesis's ``st.data()``, None where ``draws`` is False); the rule is enabled
    while ``precondition(machine)`` holds. ``name`` orders it among the rules
    (Hypothesis sorts them by name), so a renamed rule draws differently."""

    name: str
    draw: Callable[[Any, Any], list[dict]]
    precondition: Callable[[Any], bool] | None = None
    draws: bool = True
    doc: str = ""


class BatchShape(NamedTuple):
    """What a bad-input case may depend on: the batch's rows, its written end (0:
    nothing written yet), the target's capabilities, and the world's codec seed."""

    rows: int
    written: int
    capabilities: dict
    world_seed: int


def out_of_domain(op: dict, what: str) -> ValueError:
    """The ``ValueError`` an op's ``validate`` raises: ``what`` is wrong with ``op`` here.

    Such an op is a scenario's mistake, or a cut the minimizer must not make:
    a correct cache would reject it, so running it would blame the cache. Bad
    input is tested inside an ``expect_error`` op, whose inner op is not validated.
    """
    return ValueError(
        f"{op['op']}: {what} (bad input belongs in an expect_error op): {json.dumps(op)}"
    )


def require_row_counts(op: dict, field: str, rows: int) -> None:
    """``out_of_domain`` unless ``op[field]`` gives one count >= 0 for each of ``rows`` rows."""
    counts = [int(c) for c in op[field]]
    if len(counts) != rows or min(counts, default=0) < 0:
        raise out_of_domain(op, f"{field} must give a count >= 0 for each of the {rows} rows")


@dataclass(frozen=True)
class BadInput:
    """A bad-input case of the op: ``inner(batch)`` is the op that must raise ``error``
    (a builtin exception name), or None where the case does not apply to the batch.

    ``batch`` is a ``BatchShape``. ``policy``: a cache could define a meaning
    for the input (rejecting it is tqbatch's policy, check
    ``rejects_by_policy``, not the contract's ``rejects``).
    ``after_write``: the case applies only once something is written (before,
    the input may still be legal: an empty cache's first write brings any
    head count, left padding is prepared before a prefill).
    """

    case: str
    error: str
    inner: Callable[[Any], dict | None]
    policy: bool = False
    after_write: bool = False


@dataclass(frozen=True)
class Recorded:
    """A quantity a replay records about the op, compared under its own tolerance entry.

    ``keys``: prefixes of the observation keys it covers (``extract.keys``...).
    ``tolerance``: the entry written into new scenarios, with its ``reason``.
    """

    quantity: str
    keys: tuple[str, ...]
    tolerance: dict


@dataclass(frozen=True)
class Op:
    """One op of the vocabulary (docs/ops.md), declared in its own module.

    ``target(world, op)`` performs the op on the cache under test and returns
    what the oracles need; ``oracles(world, op, ctx)`` performs it on the
    numpy model, ``BatchKVCache`` and the per-request references, judges what
    the target yielded and returns what the op yields (``World.last``).
    ``validate(world, op)`` raises ``ValueError`` for an op that is malformed
    for this batch, before the target sees it (a scenario's mistake, not the
    cache's). ``needs``: capabilities of the target (``tqbatch.testing.target``).
    ``needs_of(world, op)``: the capabilities this op needs of this target,
    where they depend on both (``new``: its configuration's; ``merge``: none
    of ``merge`` itself where the batch can be built without it); default ``needs``.
    ``checks``: the checks only this op reports. ``observe(target, op,
    result)``: what a replay records of it, with ``recorded`` tolerances.
    ``fields``, ``meaning``, ``optional`` (field, meaning) and ``notes``:
    its entry in docs/ops.md.
    """

    name: str
    fields: str
    meaning: str
    target: Callable[[Any, dict], Any]
    oracles: Callable[[Any, dict, Any], Any] | None
    needs: tuple[str, ...] = ()
    needs_of: Callable[[Any, dict], tuple[str, ...]] | None = None
    validate: Callable[[Any, dict], None] | None = None
    optional: tuple[tuple[str, str], ...] = ()
    checks: tuple[Check, ...] = ()
    observe: Callable[[Any, dict, Any], dict] | None = None
    recorded: tuple[Recorded, ...] = ()
    bad_inputs: tuple[BadInput, ...] = ()
    rules: tuple[Rule, ...] = ()
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Vocabulary:
    """Every op declared, by name, and the catalogues gathered from their declarations.

    Built once from the op modules (``tqbatch.testing.contract.ops``), with
    nothing registered anywhere: ``checks`` is ``common`` (the checks every op
    is held to) followed by each op's own, in op order; ``bad_input_errors``
    the documented error of every bad-input case; ``policy_cases`` the cases a
    cache could define a meaning for (``BadInput.policy``). The executor holds
    it (``World.vocabulary``), so that an op that runs another op
    (``expect_error``) reads the vocabulary there, not by importing it.
    """

    ops: dict[str, Op]
    checks: dict[str, Check]
    bad_input_errors: dict[str, str]
    policy_cases: frozenset[str]

    @classmethod
    def of(cls, ops: dict[str, Op], common: dict[str, Check]) -> Vocabulary:
        checks = dict(common)
        for op in ops.values():
            for check in op.checks:
                if checks.get(check.name, check) != check:
                    raise ValueError(f"check {check.name!r} is declared twice")
                checks[check.name] = check
        return cls(
            ops=ops,
            checks=checks,
            bad_input_errors={b.case: b.error for op in ops.values() for b in op.bad_inputs},
            policy_cases=frozenset(
                b.case for op in ops.values() for b in op.bad_inputs if b.policy
            ),
        )

    def bad_input_cases(
        self, batch_size: int, written: int, capabilities: dict, world_seed: int
    ) -> list[tuple[str, dict]]:
        """Every bad-input ``(case, inner op)`` that applies to a batch of this geometry.

        The catalogue the ``expect_error`` rule draws from, and that a test can
        walk case by case (tqbatch's pytest plugin does): each op's
        ``bad_inputs``, for the ops whose capabilities the target offers
        (``capabilities``, ``tqbatch.testing.target``).
        """
        batch = BatchShape(batch_size, written, capabilities, world_seed)
        choices = []
        for op in self.ops.values():
            if not all(capabilities.get(c) for c in op.needs):
                continue
            for bad in op.bad_inputs:
                if bad.after_write and not written:
                    continue
                inner = bad.inner(batch)
                if inner is not None:
                    choices.append((bad.case, inner))
        return choices

    def expect_error_op(self, case: str, inner: dict) -> dict:
        """The ``expect_error`` op of bad-input ``case``: ``inner`` must raise its documented
        error (tqbatch's policy, README, Errors: TypeError for a wrong kind of object,
        IndexError for an index past the batch, ValueError for everything else)."""
        return {
            "op": "expect_error",
            "inner": inner,
            "error": self.bad_input_errors[case],
            "case": case,
        }

    def recorded_quantity(self, key: str) -> str:
        """The recorded quantity (tolerance entry) governing an observation key: an op's
        ``Recorded`` covering it, else the key's first dotted part (``state.keys.0`` is
        ``state``)."""
        for op in self.ops.values():
            for recorded in op.recorded:
                if any(key == k or key.startswith(k + ".") for k in recorded.keys):
                    return recorded.quantity
        return key.split(".", 1)[0]
