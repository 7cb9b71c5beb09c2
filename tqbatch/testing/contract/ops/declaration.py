"""What an op of the vocabulary declares, once: read by the executor, the state
machine, replay, the bad-input survey and docs/ops.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqbatch.testing.contract.checks import Check

__all__ = ["BadInput", "Op", "Recorded", "Rule"]


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


@dataclass(frozen=True)
class BadInput:
    """A bad-input case of the op: ``inner(batch)`` is the op that must raise ``error``
    (a builtin exception name), or None where the case does not apply to the batch.

    ``batch`` is a ``tqbatch.testing.contract.strategies.BatchShape``. ``policy``: a cache
    could define a meaning for the input (rejecting it is tqbatch's policy,
    check ``rejects_by_policy``, not the contract's ``rejects``).
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
