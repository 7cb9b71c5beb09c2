"""Hypothesis state machine driving any batch cache through the op vocabulary.

Kept apart from the model and the checks (as zarr does in
``zarr.testing.stateful``): the rules are the op modules' (``Op.rules``,
``tqbatch.testing.contract.ops``), which only draw op dicts; the machine hands them to
``World.apply``, and its invariant calls ``World.check``. Every op is
``note()``d as JSON, so a failing run prints a runnable op sequence. What
outlives an example goes to the machine's observer
(``tqbatch.testing.search.machine_observer``, bound by ``machine_for``): how often
each op and op pair ran, the last failure (for writing out as a golden
scenario) and the last one of every check identity
(``tqbatch.testing.contract.checks``), which after a Hypothesis run is each distinct
bug's shrunk example.

Use it from a test module::

    from tqbatch.testing.search.stateful import machine_test_case
    TestTqbatch = machine_test_case()            # $TQBATCH_IMPL or tqbatch's own

or against another class: ``machine_test_case(SomeCache)``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable

from hypothesis import note, reject
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tqbatch.testing.contract import strategies as tqs
from tqbatch.testing.contract.checks import CheckFailure, ToleratedDivergence
from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.contract.ops import OPS, Rule
from tqbatch.testing.contract.ops.batches import first_batch_ops
from tqbatch.testing.search.hypothesis_internals import no_local_constants, replaying_final
from tqbatch.testing.search.machine_observer import MachineObserver
from tqbatch.testing.target import (
    CONFIGURATIONS,
    capabilities,
    impl_spec,
    load_impl,
    missing_capabilities,
)
from tqbatch.testing.world import World

__all__ = [
    "BatchCacheMachine",
    "UnsupportedOpsWarning",
    "machine_for",
    "machine_test_case",
]


class UnsupportedOpsWarning(UserWarning):
    """The target lacks some operations; their rules are skipped."""


class BatchCacheMachine(RuleBasedStateMachine):
    """Rules for every op of docs/ops.md; set ``impl`` and ``observer`` with ``machine_for``."""

    impl: type | None = None
    contract_checks: bool = True
    # Failures to note and run past instead of raising (see FailureCollector).
    tolerate: Callable[[CheckFailure], bool] | None = None
    # Bad-input cases not to draw (a survey's: each is already reported, and
    # an accepted bad input diverges the target, cutting the op sequence short).
    avoid_cases: frozenset = frozenset()
    # Told of every op run and every failure recorded, by every example
    # (Hypothesis makes a machine per example); None: nobody is told.
    observer: MachineObserver | None = None

    def __init__(self):
        super().__init__()
        self.world: World | None = None
        self.config: dict = {}
        self.previous_op: str | None = None
        # Worlds this example left at a known, diverging failure (``_continue_fresh``).
        self.left_behind: list[World] = []

    @property
    def worlds(self) -> list[World]:
        """Every world of this example, in order: those left behind, then the current one."""
        return [*self.left_behind, *([self.world] if self.world is not None else [])]

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
            except ToleratedDivergence as known:
                # Already reported (or listed), and the target has diverged: the
                # rest of this op sequence would only repeat it.
                self._continue_fresh(known)
                return
            except BaseException as exc:
                self._record(exc)
                raise
            name = op["op"]
            if self.observer is not None:
                self.observer.op_ran(self.previous_op, name)
            self.previous_op = name

    def _continue_fresh(self, known: ToleratedDivergence):
        """Go on in a fresh world, its cache built by the constructor, after ``known``.

        Ending the example there would leave every op after the known
        failure unreachable wherever it comes early (a listed crash after a
        state round trip ends most examples against mlx-vlm's class). The
        fresh world's ops start with its ``new`` op, so a failure found
        later replays from there alone. Where the fresh cache itself fails
        the known way, the example ends, as it did before.
        """
        if self.left_behind and len(self.world.ops) <= 1:
            reject()  # the constructor alone diverges: nothing fresh to go on with
        rows = max(1, self.world.numpy_model.batch_size)
        note(f"known failure {known.failure.identity}: continuing on a fresh cache")
        self.left_behind.append(self.world)
        self.world = self._make_world()
        self._run({"op": "new", "left_padding": [0] * rows})

    def _make_world(self) -> World:
        return World(
            type(self).impl or load_impl(),
            contract_checks=type(self).contract_checks,
            tolerate=type(self).tolerate,
            **self.config,
        )

    def _record(self, exc: BaseException):
        impl = self.world.impl
        failure = Failure.of(
            exc,
            impl=impl_spec(impl),
            config=dict(self.config),
            ops=list(self.world.ops),
            final=replaying_final(),
        )
        if self.observer is not None:
            self.observer.failed(failure)

    @property
    def numpy_model(self):
        return self.world.numpy_model

    def has(self, capability: str) -> bool:
        return self.world is not None and bool(self.caps.get(capability))

    # -------------------------------------------------------------- start

    @initialize(config=tqs.configs(), data=st.data())
    def start(self, config, data):
        impl = type(self).impl or load_impl()
        self.config = config
        note(f"World({impl_spec(impl)}, **{json.dumps(config)})")
        self.world = self._make_world()
        self._run(*data.draw(first_batch_ops(self.caps), label="first batch"))

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
        except ToleratedDivergence as known:
            self._continue_fresh(known)
        except BaseException as exc:
            self._record(exc)
            raise


def _rule_method(declared: Rule):
    """The machine's method for a declared rule: run the ops it draws."""
    if declared.draws:

        def method(self, data):
            self._run(*declared.draw(self, data))

        method = rule(data=st.data())(_named(method, declared))
    else:

        def method(self):
            self._run(*declared.draw(self, None))

        method = rule()(_named(method, declared))
    if declared.precondition is not None:
        method = precondition(declared.precondition)(method)
    return method


def _named(function, declared: Rule):
    function.__name__ = function.__qualname__ = declared.name
    function.__doc__ = declared.doc or None
    return function


# Every op module's rules (Hypothesis orders rules by name, not by this order).
for _op in OPS.values():
    for _declared in _op.rules:
        if hasattr(BatchCacheMachine, _declared.name):
            raise ValueError(f"rule {_declared.name!r} is declared twice")
        setattr(BatchCacheMachine, _declared.name, _rule_method(_declared))


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
    """A ``unittest.TestCase`` running the machine against ``impl`` under the active profile.

    As in a campaign, Hypothesis draws no constants from the local code around it
    (``hypothesis_internals.no_local_constants``): the same examples in any project.
    """
    machine = machine_for(impl, contract_checks=contract_checks)

    class MachineTest(machine.TestCase):
        def runTest(self):
            with no_local_constants():
                super().runTest()

        # What Hypothesis marks its own runTest with (its pytest plugin reads them).
        runTest.is_hypothesis_test = True
        runTest._hypothesis_state_machine_class = machine

    MachineTest.__name__ = MachineTest.__qualname__ = f"{machine.__name__}Test"
    return MachineTest
