"""Hypothesis state machine driving any batch cache through the op vocabulary.

Kept apart from the model and the checks (as zarr does in
``zarr.testing.stateful``): rules only draw op dicts (``strategies``) and hand
them to ``World.apply``; the invariant calls ``World.check``. Every op is
``note()``d as JSON, so a failing run prints a runnable op sequence, and the
last failure is kept in ``BatchCacheMachine.last_failure`` for writing out as
a golden scenario.

Use it from a test module::

    from tqbatch.testing.stateful import machine_test_case
    TestTqbatch = machine_test_case()            # $TQBATCH_IMPL or tqbatch's own

or against another class: ``machine_test_case(SomeCache)``.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tqbatch.testing import strategies as tqs
from tqbatch.testing.impl import load_impl, missing_capabilities
from tqbatch.testing.ops import World, format_ops

__all__ = [
    "BatchCacheMachine",
    "Failure",
    "UnsupportedOpsWarning",
    "machine_for",
    "machine_test_case",
]


class UnsupportedOpsWarning(UserWarning):
    """The target lacks some operations; their rules are skipped."""


@dataclass
class Failure:
    """A failing run: the world configuration, the ops up to the failure, the message."""

    impl: str
    config: dict
    ops: list = field(default_factory=list)
    message: str = ""

    def as_scenario(self) -> dict:
        return {"impl": self.impl, "config": self.config, "ops": self.ops, "error": self.message}


class BatchCacheMachine(RuleBasedStateMachine):
    """Rules for every op of docs/ops.md; set ``impl`` with ``machine_for``."""

    impl: type | None = None
    contract_checks: bool = True
    last_failure: Failure | None = None
    # How often each op ran in this process, for campaign summaries.
    op_counts: dict = {}
    pair_counts: dict = {}

    def __init__(self):
        super().__init__()
        self.world: World | None = None
        self.config: dict = {}
        self._previous_op: str | None = None

    # -------------------------------------------------------------- helpers

    @property
    def caps(self) -> dict:
        return self.world.capabilities

    def _run(self, *ops: dict, check_between: bool = True):
        for i, op in enumerate(ops):
            note(json.dumps(op))
            try:
                self.world.apply(op)
                if check_between and i < len(ops) - 1:
                    self.world.check()
            except BaseException as exc:
                self._record(exc)
                raise
            name = op["op"]
            counts = type(self).op_counts
            counts[name] = counts.get(name, 0) + 1
            if self._previous_op is not None:
                pair = (self._previous_op, name)
                type(self).pair_counts[pair] = type(self).pair_counts.get(pair, 0) + 1
            self._previous_op = name

    def _record(self, exc: BaseException):
        impl = self.world.impl
        type(self).last_failure = Failure(
            impl=f"{impl.__module__}:{impl.__qualname__}",
            config=dict(self.config),
            ops=list(self.world.ops),
            message=f"{type(exc).__name__}: {exc}",
        )

    @property
    def model(self):
        return self.world.model

    def _has(self, capability: str) -> bool:
        return self.world is not None and bool(self.caps.get(capability))

    # -------------------------------------------------------------- start

    @initialize(config=tqs.configs(), data=st.data())
    def start(self, config, data):
        impl = type(self).impl or load_impl()
        self.config = config
        note(f"World({impl.__module__}:{impl.__qualname__}, **{json.dumps(config)})")
        self.world = World(impl, contract_checks=type(self).contract_checks, **config)
        self._run(*data.draw(tqs.first_batch_ops(self.caps), label="first batch"))

    # -------------------------------------------------------------- writes

    @rule(data=st.data())
    def decode(self, data):
        """One token per row (T = 1), with attention."""
        op = data.draw(tqs.attend_op(self.world.kv_heads, max_queries=1), label="decode")
        self._run(op)

    @rule(data=st.data())
    def append_block(self, data):
        """A multi-token block: a plain update or a forward step with N > 1 queries."""
        if data.draw(st.booleans(), label="with attention"):
            op = data.draw(tqs.attend_op(self.world.kv_heads), label="block")
        else:
            op = {
                "op": "update",
                "tokens": data.draw(st.integers(2, 4), label="tokens"),
                "kv_seed": data.draw(tqs.seeds, label="kv_seed"),
            }
        self._run(op)

    @precondition(lambda self: self._has("prepare") and self._has("finalize"))
    @rule(data=st.data())
    def right_padded_append(self, data):
        """prepare(right_padding) + block + finalize on the current batch."""
        ops = data.draw(tqs.right_padded_prefill_ops(rows=self.model.batch_size), label="ops")
        B = self.model.batch_size
        if self._has("filter") and B > 1 and data.draw(st.booleans(), label="filter pending"):
            # A request finishes while right padding is pending.
            keep = data.draw(tqs.filter_indices(self.model.left_padding), label="keep")
            ops.insert(-1, {"op": "filter", "indices": keep})
        self._run(*ops)

    # -------------------------------------------------------------- reshaping

    @precondition(lambda self: self._has("filter"))
    @rule(data=st.data())
    def filter(self, data):
        keep = data.draw(tqs.filter_indices(self.model.left_padding), label="keep")
        self._run({"op": "filter", "indices": keep})

    @precondition(lambda self: self._has("extend") and self.model.batch_size < tqs.MAX_ROWS)
    @rule(data=st.data())
    def extend(self, data):
        room = tqs.MAX_ROWS - self.model.batch_size
        other = data.draw(tqs.other_batch_ops(self.caps, max_rows=min(2, room)), label="other")
        op = {"op": "extend", "other": other}
        if data.draw(st.integers(0, 3), label="full precision") == 0:
            op["as_dense"] = True  # joiners handed over in mlx-lm's BatchKVCache
        self._run(op)

    @precondition(lambda self: self._has("extract"))
    @rule(data=st.data())
    def extract(self, data):
        index = data.draw(st.integers(0, self.model.batch_size - 1), label="index")
        self._run({"op": "extract", "index": index})

    @precondition(lambda self: self._has("trim"))
    @rule(data=st.data())
    def speculative_rollback(self, data):
        """Write a verify block, then trim part or all of it (at any B)."""
        block = data.draw(st.integers(1, 4), label="block")
        n = data.draw(st.integers(0, block), label="n")
        self._run(
            {"op": "update", "tokens": block, "kv_seed": data.draw(tqs.seeds, label="kv_seed")},
            {"op": "trim", "n": n},
        )

    @precondition(lambda self: self._has("trim") and min(self.model.offsets) > 0)
    @rule(data=st.data())
    def trim(self, data):
        n = data.draw(st.integers(0, min(self.model.offsets)), label="n")
        self._run({"op": "trim", "n": n})

    # Back-to-back round trips test nothing new and, taking no draws, would
    # otherwise crowd out the rules that do.
    @precondition(lambda self: self._has("roundtrip") and self._previous_op != "roundtrip")
    @rule()
    def roundtrip(self):
        self._run({"op": "roundtrip"})

    @precondition(lambda self: self._has("merge"))
    @rule(data=st.data())
    def restart_with_merge(self, data):
        """A new batch from singles (the old one is finished)."""
        self._run(data.draw(tqs.merge_op(rebatch=True), label="merge"))

    # -------------------------------------------------------------- bad input

    @rule(data=st.data())
    def bad_input(self, data):
        op = data.draw(
            tqs.bad_input_op(self.model.batch_size, self.model.end, self.caps, self.world.seed),
            label="bad input",
        )
        self._run(op)

    # -------------------------------------------------------------- invariant

    @invariant()
    def consistent(self):
        if self.world is None:
            return
        try:
            self.world.check()
        except BaseException as exc:
            self._record(exc)
            raise


def machine_for(
    impl: type | None = None, *, contract_checks: bool = True
) -> type[BatchCacheMachine]:
    """A ``BatchCacheMachine`` subclass bound to ``impl`` (default: ``load_impl()``).

    Warns ``UnsupportedOpsWarning`` naming the operations whose rules are
    skipped because the class lacks them. ``contract_checks=False`` leaves
    out the structural checks of ``World`` (see its docstring).
    """
    impl = impl if impl is not None else load_impl()
    missing = missing_capabilities(impl)
    if missing:
        warnings.warn(
            f"{impl.__module__}.{impl.__qualname__} lacks {', '.join(missing)}: "
            "the state machine skips the rules that need them",
            UnsupportedOpsWarning,
            stacklevel=2,
        )
    return type(
        f"BatchCacheMachine_{impl.__name__}",
        (BatchCacheMachine,),
        {
            "impl": impl,
            "contract_checks": contract_checks,
            "op_counts": {},
            "pair_counts": {},
            "last_failure": None,
        },
    )


def machine_test_case(impl: type | None = None, *, contract_checks: bool = True):
    """A ``unittest.TestCase`` running the machine against ``impl`` under the active profile."""
    return machine_for(impl, contract_checks=contract_checks).TestCase


def failure_report(failure: Failure) -> str:
    """Human-readable failing op sequence."""
    return (
        f"{failure.impl} with {json.dumps(failure.config)} failed: {failure.message}\n"
        f"ops:\n{format_ops(failure.ops)}"
    )
