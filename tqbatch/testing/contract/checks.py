"""The checks of the op executor, each with its own identity and level.

A failing check raises a ``CheckFailure``: an ``AssertionError`` whose class is
distinct for every *identity* (check name plus the op, or bad-input case, it
fired on). Hypothesis tells bugs apart by exception class and raise site, so
a campaign that keeps going after a failure (``tqbatch fuzz --survey``)
shrinks and reports each identity as its own bug, and a mutant of the
self-test counts as caught only by the check it names.

Levels:

``contract``
    Geometry and numerics: lockstep with mlx-lm's ``BatchKVCache``, masks,
    the physical written end, content and attention against the references.
    A cache that fails one does not conform.
``policy``
    Where tqbatch chose one legal behaviour and mlx-lm's ``BatchKVCache``
    (or another cache) another: with which exception type bad input is
    rejected, whether input a cache could give a meaning to (an empty or
    repeating ``filter``) is rejected at all, and what ``extract`` and a
    ``state`` round trip make of right padding still pending (between
    ``prepare`` and ``finalize``: BatchKVCache hands it out as tokens and
    does not save it). A cache with another legal policy is reported as
    differing, not as non-conforming. Accepting input that has no sound
    meaning (a row that does not exist, K/V of another shape, rows of
    another codec) is a contract failure (``rejects``): the cache silently
    computes garbage. So is a rejected op that *changes* the cache
    (``unchanged``).
``harness``
    The oracles disagree with each other: a bug in tqbatch.testing.

Every check runs after every op, whatever the others found: a failure
carries the other checks that failed after the same op (``also``), each
its own identity. A check that cannot be evaluated because another failed
(content when ``dequantize()`` has the wrong shape) is skipped.

``diverged`` says whether the target's state can still be compared with the
oracles after the check failed: a wrong ``size()`` is an observation, a
wrong ``offset`` means every later write lands elsewhere. A survey keeps
running past a known failure only where it has not diverged.

``per_op`` says whether the op belongs to the identity. A mask that is wrong
after ``filter`` and one wrong after ``merge`` are two bugs; an ``_idx``
attribute or a ``size()`` of the wrong type is one standing property of the
cache, seen after every op, and one identity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = [
    "COMMON_CHECKS",
    "CONTRACT",
    "HARNESS",
    "POLICY",
    "Check",
    "CheckFailure",
    "ToleratedDivergence",
    "failure",
    "identity",
    "where_of",
]

CONTRACT, POLICY, HARNESS = "contract", "policy", "harness"


@dataclass(frozen=True)
class Check:
    """One check of the harness: its name, level, whether a failure diverges the target."""

    name: str
    level: str
    diverged: bool
    what: str
    per_op: bool = True


# The checks every op is held to (after every op: ``tqbatch.testing.contract.invariants``)
# and the executor's own. Each op module declares the checks only it reports
# (``Op.checks``); the whole catalogue, these first, is ``CHECKS`` of
# ``tqbatch.testing.contract.ops``, gathered from the op declarations.
COMMON_CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check("raises", CONTRACT, True, "a legal op completes without raising"),
        Check("read", CONTRACT, True, "size(), make_mask() and dequantize() can be called"),
        Check("structure", CONTRACT, False, "no `_idx` attribute beside packed keys", False),
        Check("offset", CONTRACT, True, "offset equals BatchKVCache's"),
        Check("left_padding", CONTRACT, True, "left_padding equals BatchKVCache's"),
        Check("size_type", CONTRACT, False, "size() returns a Python int", False),
        Check("size", CONTRACT, False, "size() equals BatchKVCache's written end", False),
        Check(
            "mask_form", CONTRACT, False, "make_mask(N, return_array=True) is a bool array", False
        ),
        Check("mask_shape", CONTRACT, False, "make_mask's shape equals BatchKVCache's"),
        Check("mask_values", CONTRACT, False, "make_mask's entries equal BatchKVCache's"),
        Check(
            "default_mask",
            CONTRACT,
            False,
            "make_mask(N) as models call it masks what BatchKVCache's masks",
        ),
        Check("written_end", CONTRACT, True, "dequantize() spans exactly the written end"),
        Check(
            "dequantize",
            CONTRACT,
            True,  # rows that cannot be told apart are no longer the model's rows
            "dequantize() returns 4-D float (keys, values), one row per batch row",
        ),
        Check("content", CONTRACT, True, "each row's K/V equal its per-request reference"),
        Check("harness", HARNESS, True, "the numpy model and BatchKVCache agree"),
    )
}


def identity(check: str, where: str | None) -> str:
    """``check@where``: what failed, and on which op (or bad-input case); ``check`` alone
    for a check that is not per op."""
    return f"{check}@{where}" if where else check


class CheckFailure(AssertionError):
    """A check failed after ``op``; ``str()`` is the message."""

    check: Check
    where: str | None

    def __init__(self, message: str, what: str = ""):
        super().__init__(message)
        self.what = what or message
        # The other failures after the same op, in check order (set where it is raised).
        self.also: list[CheckFailure] = []

    @property
    def identity(self) -> str:
        return identity(self.check.name, self.where)

    @property
    def level(self) -> str:
        return self.check.level


class ToleratedDivergence(Exception):
    """A tolerated check failed where the target's state has diverged: stop here.

    Raised by ``World`` in place of a ``CheckFailure`` it was told to
    tolerate (a survey's already-reported failures); the state machine ends
    the example without reporting it.
    """

    def __init__(self, failure: CheckFailure):
        super().__init__(str(failure))
        self.failure = failure


_CLASSES: dict[str, type[CheckFailure]] = {}


def _class_for(check: Check, where: str | None) -> type[CheckFailure]:
    key = identity(check.name, where)
    cls = _CLASSES.get(key)
    if cls is None:
        # One class per identity: Hypothesis's InterestingOrigin includes the
        # exception type, so distinct identities are distinct bugs to it.
        label = "".join(part.title() for part in f"{check.name}_{where or ''}".split("_") if part)
        label = "".join(ch for ch in label if ch.isalnum())
        cls = type(f"{label}Failure", (CheckFailure,), {"check": check, "where": where})
        cls.__module__ = __name__
        _CLASSES[key] = cls
    return cls


def where_of(op: dict | None) -> str:
    """The op part of an identity: the op's name, a bad input's ``case``, or ``start``."""
    if not op:
        return "start"
    if op.get("op") == "expect_error":
        return op.get("case") or f"bad {op['inner']['op']}"
    return str(op.get("op"))


def failure(check: Check, op: dict | None, what: str) -> CheckFailure:
    """The ``CheckFailure`` of ``check`` after ``op``, with the usual message."""
    cls = _class_for(check, where_of(op) if check.per_op else None)
    return cls(f"[{check.name}] after {json.dumps(op) if op else 'start'}: {what}", what)
