"""Hypothesis state machine driving any batch cache through the op vocabulary.

Kept apart from the model and the checks (as zarr does in
``zarr.testing.stateful``): rules only draw op dicts (``strategies``) and hand
them to ``World.apply``; the invariant calls ``World.check``. Every op is
``note()``d as JSON, so a failing run prints a runnable op sequence. What
outlives an example goes to the machine's observer
(``tqbatch.testing.machine_observer``, bound by ``machine_for``): how often
each op and op pair ran, the last failure (for writing out as a golden
scenario) and the last one of every check identity
(``tqbatch.testing.checks``), which after a Hypothesis run is each distinct
bug's shrunk example.

Use it from a test module::

    from tqbatch.testing.stateful import machine_test_case
    TestTqbatch = machine_test_case()            # $TQBATCH_IMPL or tqbatch's own

or against another class: ``machine_test_case(SomeCache)``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import note, reject
from hypothesis import strategies as st
from hypothesis.control import current_build_context, currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tqbatch.testing import strategies as tqs
from tqbatch.testing.checks import CheckFailure, KnownFailure
from tqbatch.testing.impl import (
    CONFIGURATIONS,
    capabilities,
    impl_spec,
    load_impl,
    missing_capabilities,
)
from tqbatch.testing.machine_observer import MachineObserver
from tqbatch.testing.ops import World

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
    """A failing run: the world configuration, the ops up to the failure, the message.

    ``identity``, ``check`` and ``level`` come from the ``CheckFailure`` (empty
    for anything else, e.g. a crash of the harness itself); ``also`` the
    identities of the other checks that failed after the same op (tolerated
    ones left out); ``final`` says whether Hypothesis was replaying its
    shrunk example when it was recorded.
    """

    impl: str
    config: dict
    ops: list = field(default_factory=list)
    message: str = ""
    identity: str = ""
    check: str = ""
    level: str = ""
    what: str = ""
    also: list = field(default_factory=list)
    final: bool = False


class BatchCacheMachine(RuleBasedStateMachine):
    """Rules for every op of docs/ops.md; set ``impl`` and ``observer`` with ``machine_for``."""

    impl: type | None = None
    contract_checks: bool = True
    # Failures to note and run past instead of raising (see World._report).
    tolerate: Callable[[CheckFailure], bool] | None = None
    # Bad-input cases not to draw (a survey's: each is already reported, and
    # an accepted bad input ends the example, which would starve the search).
    avoid_cases: frozenset = frozenset()
    # Told of every op run and every failure recorded, by every example
    # (Hypothesis makes a machine per example); None: nobody is told.
    observer: MachineObserver | None = None

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
            except KnownFailure:
                reject()  # already reported, and the target has diverged: end the example
            except BaseException as exc:
                self._record(exc)
                raise
            name = op["op"]
            if self.observer is not None:
                self.observer.op_ran(self._previous_op, name)
            self._previous_op = name

    def _record(self, exc: BaseException):
        impl = self.world.impl
        checked = isinstance(exc, CheckFailure)
        failure = Failure(
            impl=impl_spec(impl),
            config=dict(self.config),
            ops=list(self.world.ops),
            message=f"{type(exc).__name__}: {exc}" if not checked else str(exc),
            identity=exc.identity if checked else "",
            check=exc.check.name if checked else "",
            level=exc.level if checked else "",
            what=exc.what if checked else "",
            also=[f.identity for f in exc.also] if checked else [],
            final=currently_in_test_context() and current_build_context().is_final,
        )
        if self.observer is not None:
            self.observer.failed(failure)

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
        note(f"World({impl_spec(impl)}, **{json.dumps(config)})")
        self.world = World(
            impl,
            contract_checks=type(self).contract_checks,
            tolerate=type(self).tolerate,
            **config,
        )
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
            # Now and then a long prompt: buffers grow in 256-slot steps, and
            # bugs of the physical end show only past the first step.
            long = data.draw(st.integers(0, 39), label="long") == 27
            op = {
                "op": "update",
                "tokens": data.draw(
                    st.integers(200, 300) if long else st.integers(2, 4), label="tokens"
                ),
                "kv_seed": data.draw(tqs.seeds, label="kv_seed"),
            }
        self._run(op)

    @precondition(lambda self: self._has("prepare") and self._has("finalize"))
    @rule(data=st.data())
    def right_padded_append(self, data):
        """prepare(right_padding) + block + finalize on the current batch."""
        ops = data.draw(tqs.right_padded_prefill_ops(rows=self.model.batch_size), label="ops")
        B = self.model.batch_size
        # Between the prefill and finalize, while right padding is pending: a
        # request finishes, one is read out, the cache is saved and restored,
        # or another batch joins. (A trim there is not a state servers make.)
        between = ["none", "filter", "extract", "roundtrip", "extend"]
        what = data.draw(st.sampled_from(between), label="while pending")
        if what == "filter" and self._has("filter") and B > 1:
            keep = data.draw(tqs.filter_indices(self.model.left_padding), label="keep")
            ops.insert(-1, {"op": "filter", "indices": keep})
        elif what == "extract" and self._has("extract"):
            index = data.draw(st.integers(0, B - 1), label="index")
            ops.insert(-1, {"op": "extract", "index": index})
        elif what == "roundtrip" and self._has("roundtrip"):
            ops.insert(-1, {"op": "roundtrip"})
        elif what == "extend" and self._has("extend") and B < tqs.MAX_ROWS:
            room = min(2, tqs.MAX_ROWS - B)
            other = data.draw(tqs.other_batch_ops(self.caps, max_rows=room), label="other")
            ops.insert(-1, {"op": "extend", "other": other})
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
            tqs.bad_input_op(
                self.model.batch_size,
                self.model.end,
                self.caps,
                self.world.seed,
                avoid=type(self).avoid_cases,
            ),
            label="bad input",
        )
        self._run(op)

    # -------------------------------------------------------------- invariant

    @invariant()
    def consistent(self):
        if self.world is None:
            return
        if self.world.ops and self.world.ops[-1]["op"] == "expect_error":
            # The op was rejected and its snapshot (geometry, every checked
            # mask, content, codecs) proved the target unchanged since the
            # last check: checking again would only repeat it.
            return
        try:
            self.world.check()
        except KnownFailure:
            reject()
        except BaseException as exc:
            self._record(exc)
            raise


def machine_for(
    impl: type | None = None,
    *,
    contract_checks: bool = True,
    tolerate: Callable[[CheckFailure], bool] | None = None,
    observer: MachineObserver | None = None,
) -> type[BatchCacheMachine]:
    """A ``BatchCacheMachine`` subclass bound to ``impl`` (default: ``load_impl()``).

    Warns ``UnsupportedOpsWarning`` naming the operations whose rules are
    skipped because the class lacks them. ``contract_checks=False`` leaves
    out the structural checks of ``World`` (see its docstring); ``tolerate``
    picks failures to run past (see ``World``). Its examples report their
    ops and failures to ``observer`` (default: a new ``MachineObserver``),
    which it keeps as ``observer``.
    """
    impl = impl if impl is not None else load_impl()
    missing = missing_capabilities(impl)
    if missing:
        warnings.warn(
            f"{impl_spec(impl)} lacks {', '.join(missing)}: "
            "the state machine skips the rules that need them",
            UnsupportedOpsWarning,
            stacklevel=2,
        )
    configured = {}
    caps = capabilities(impl)
    if not all(caps[name] for name in CONFIGURATIONS):
        # Configurations its constructor cannot take are not drawn (reported by
        # impl.unsupported_configurations, not failed); other targets keep the
        # base class's rule, and so their examples.
        @initialize(config=tqs.configs(caps), data=st.data())
        def start(self, config, data):
            BatchCacheMachine.start(self, config, data)

        configured["start"] = start
    return type(
        f"BatchCacheMachine_{impl.__name__}",
        (BatchCacheMachine,),
        {
            **configured,
            "impl": impl,
            "contract_checks": contract_checks,
            "tolerate": staticmethod(tolerate) if tolerate else None,
            "observer": observer if observer is not None else MachineObserver(),
        },
    )


def machine_test_case(impl: type | None = None, *, contract_checks: bool = True):
    """A ``unittest.TestCase`` running the machine against ``impl`` under the active profile."""
    return machine_for(impl, contract_checks=contract_checks).TestCase
