"""The op vocabulary of docs/ops.md: one module per op, each declaring it once (``Op``).

An op's module holds everything about it: its inputs (Hypothesis strategies
and bad-input cases), what it does to the target and to each oracle, the
checks only it reports, what a replay records of it and under which
tolerance, the state-machine rules that draw it, and its docs entry. Adding
an op is adding a module here: every module but the ones the ops share
(``SHARED``) declares one, ``OP``, named after the module.

``VOCABULARY`` is every op, gathered once from the modules, with the
catalogues built over all of them (``Vocabulary``): the checks (``CHECKS``:
the common ones of ``tqbatch.testing.contract.checks``, then each op's own),
the bad-input cases and their errors (``bad_input_cases``,
``BAD_INPUT_ERRORS``, ``POLICY_CASES``) and the recorded quantities
(``recorded_quantity``). The executor (``tqbatch.testing.world.World``), the
state machine (``tqbatch.testing.search.stateful``), replay
(``tqbatch.testing.replay.replayer``) and docs/ops.md (``python -m
tqbatch.testing.contract.ops``) read them here.
"""

from __future__ import annotations

import importlib
import pkgutil

from tqbatch.testing.contract.checks import COMMON_CHECKS, Check
from tqbatch.testing.contract.ops.declaration import BadInput, Op, Recorded, Rule, Vocabulary

__all__ = [
    "BAD_INPUT_ERRORS",
    "CHECKS",
    "OPS",
    "POLICY_CASES",
    "SHARED",
    "VOCABULARY",
    "BadInput",
    "Op",
    "Recorded",
    "Rule",
    "Vocabulary",
    "bad_input_cases",
    "expect_error_op",
    "recorded_quantity",
]

# Modules the op modules share, declaring no op: the declaration types, and
# strategies for a batch's first ops (which draw ``merge`` and ``new``).
SHARED = ("declaration", "batches")


def _load() -> dict[str, Op]:
    """Every module of this package that declares an ``OP``, by module name."""
    ops = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if module.startswith("_") or module in SHARED:
            continue
        op = importlib.import_module(f"{__name__}.{module}").OP
        if op.name != module:
            raise ValueError(
                f"{__name__}.{module} declares op {op.name!r}: name it after its module"
            )
        ops[op.name] = op
    return ops


VOCABULARY = Vocabulary.of(_load(), COMMON_CHECKS)
OPS: dict[str, Op] = VOCABULARY.ops
CHECKS: dict[str, Check] = VOCABULARY.checks
BAD_INPUT_ERRORS: dict[str, str] = VOCABULARY.bad_input_errors
POLICY_CASES: frozenset[str] = VOCABULARY.policy_cases
bad_input_cases = VOCABULARY.bad_input_cases
expect_error_op = VOCABULARY.expect_error_op
recorded_quantity = VOCABULARY.recorded_quantity
