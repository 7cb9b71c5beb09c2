"""The op vocabulary of docs/ops.md: one module per op, each declaring it once (``Op``).

An op's module holds everything about it: its inputs (Hypothesis strategies
and bad-input cases), what it does to the target and to each oracle, the
checks only it reports, what a replay records of it and under which
tolerance, the state-machine rules that draw it, and its docs entry. The
executor (``tqbatch.testing.world.World``), the state machine
(``tqbatch.testing.search.stateful``), replay (``tqbatch.testing.replay.scenario``), the
bad-input survey (``tqbatch.testing.contract.strategies.bad_input_cases``) and
docs/ops.md (``python -m tqbatch.testing.contract.ops``) read ``OPS``. Adding an op is
adding a module here: every module but ``declaration`` declares one, ``OP``,
named after the module.
"""

from __future__ import annotations

import importlib
import pkgutil

from tqbatch.testing.contract import checks as _checks
from tqbatch.testing.contract.ops.declaration import BadInput, Op, Recorded, Rule

__all__ = ["OPS", "BadInput", "Op", "Recorded", "Rule", "policy_cases", "recorded_quantity"]


def _load() -> dict[str, Op]:
    """Every module of this package that declares an ``OP``, by module name."""
    ops = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if module.startswith("_") or module == "declaration":
            continue
        op = importlib.import_module(f"{__name__}.{module}").OP
        if op.name != module:
            raise ValueError(
                f"{__name__}.{module} declares op {op.name!r}: name it after its module"
            )
        ops[op.name] = op
        _checks.register(op.checks)
    return ops


OPS: dict[str, Op] = _load()


def policy_cases() -> frozenset[str]:
    """Bad-input cases a cache could define a meaning for (``BadInput.policy``)."""
    return frozenset(b.case for op in OPS.values() for b in op.bad_inputs if b.policy)


def recorded_quantity(key: str) -> str:
    """The recorded quantity (tolerance entry) governing an observation key: an op's
    ``Recorded`` covering it, else the key's first dotted part (``state.keys.0`` is
    ``state``)."""
    for op in OPS.values():
        for recorded in op.recorded:
            if any(key == k or key.startswith(k + ".") for k in recorded.keys):
                return recorded.quantity
    return key.split(".", 1)[0]


_MOVED = {
    "World": "tqbatch.testing.world",
    "UnsupportedOp": "tqbatch.testing.world",
    "format_ops": "tqbatch.testing.world",
    "POISON": "tqbatch.testing.oracles.generation",
    "MASK_CHECKS": "tqbatch.testing.contract.invariants",
}


def __getattr__(name: str):
    # The executor lived here before the ops had modules of their own; it
    # imports this package, so it is loaded on first use, not at import.
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
