"""Every use of Hypothesis's internals by the search, in one place.

Hypothesis's public API does not let a campaign count test runs, bound
shrinking by runs rather than seconds, key its examples in a database, or
tell a shrunk example's final replay; so these reach into modules and
attributes Hypothesis does not promise to keep. Each degrades gracefully
(does nothing, or reports nothing) where the Hypothesis in use lacks what it
reaches for. Nothing else of tqbatch imports ``hypothesis.internal`` or sets a
``_hypothesis_internal`` attribute: when Hypothesis changes, this module is
what to read.

- ``RunClock`` and ``shrink_budget``: the engine's clock and shrinking bound
  (``hypothesis.internal.conjecture.engine``);
- ``observability`` and ``no_coverage_tracing``: its observability callbacks
  and coverage flag (``hypothesis.internal.observability``);
- ``run_machine``: a state machine's test under an explicit database key, the
  class digested once (``hypothesis.stateful.function_digest``), optionally
  without the engine's simplest example (``hypothesis.internal.conjecture.engine``);
- ``no_local_constants``: its pool of constants found in the code around it
  (``hypothesis.internal.conjecture.providers``);
- ``replaying_final``: whether the running example is the shrunk one's
  final replay (``hypothesis.control``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from unittest import mock

import hypothesis.stateful
from hypothesis import settings
from hypothesis.control import current_build_context, currently_in_test_context
from hypothesis.reporting import current_reporter, with_reporter
from hypothesis.stateful import get_state_machine_test

__all__ = [
    "RunClock",
    "no_coverage_tracing",
    "no_local_constants",
    "observing",
    "replaying_final",
    "run_machine",
    "shrink_budget",
]


class RunClock:
    """A clock that reads test runs, for Hypothesis's engine (see ``shrink_budget``).

    The machine under test calls ``tick()`` once per test run.
    """

    def __init__(self):
        self.runs = 0

    def tick(self):
        self.runs += 1

    def perf_counter(self) -> float:
        return float(self.runs)

    monotonic = perf_counter

    def __getattr__(self, name):  # anything else the engine reads of ``time``
        return getattr(time, name)


@contextlib.contextmanager
def shrink_budget(runs: int | None, clock: RunClock) -> Iterator[None]:
    """Bound Hypothesis's shrinking to ``runs`` test runs (None: its own bound, 300 s).

    Hypothesis bounds shrinking in seconds (an engine constant read when
    shrinking starts), so where it stops, and which failure it reports,
    would depend on the machine's speed. Inside this context the engine's
    clock is ``clock``, which counts runs, and the constant is ``runs``.
    The engine's other timing rule (generate for at most 10 s after a first
    bug, when several bugs are reported) becomes 10 runs.
    """
    try:  # engine internals: a module-level ``time`` and the constant
        from hypothesis.internal.conjecture import engine
    except ImportError:  # pragma: no cover - depends on the Hypothesis version
        yield
        return
    saved_clock = getattr(engine, "time", None)
    saved = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if runs is None or saved is None or saved_clock is not time:
        yield  # no bound asked for, or another Hypothesis: its own bound, in seconds
        return
    engine.time, engine.MAX_SHRINKING_SECONDS = clock, runs
    previous = current_reporter()

    def reporter(text):
        # Hypothesis's note for its own deadline says "five minutes": not ours.
        if not str(text).startswith("WARNING: Hypothesis has spent more than five minutes"):
            previous(text)

    try:
        with with_reporter(reporter):
            yield
    finally:
        engine.time, engine.MAX_SHRINKING_SECONDS = saved_clock, saved


@contextlib.contextmanager
def observing(callback):
    """``callback`` gets Hypothesis's observation of every test run while the block runs,
    with no line coverage collected for them (``no_coverage_tracing``); the block gets
    whether it does (False where this Hypothesis has no observability callbacks)."""
    try:  # an internal module of Hypothesis: counts degrade gracefully without it
        from hypothesis.internal.observability import (
            add_observability_callback,
            remove_observability_callback,
        )
    except ImportError:  # pragma: no cover - depends on the Hypothesis version
        yield False
        return
    with no_coverage_tracing():
        add_observability_callback(callback)
        try:
            yield True
        finally:
            remove_observability_callback(callback)


@contextlib.contextmanager
def no_coverage_tracing():
    """Hypothesis collects no line coverage while the campaign observes its runs.

    With an observability callback registered, Hypothesis traces every line
    of every test run for the observations' coverage field, which the
    campaign never reads: on Python 3.11 a ``sys.settrace`` tracer that cost
    a quarter to a third of a campaign's time (docs/search-speed.md).
    Hypothesis reads the flag at each run and exposes it for this
    (``OBSERVABILITY_COLLECT_COVERAGE``); its environment variable would
    also write every observation to disk.
    Tracing does not steer generation, so the examples drawn are the same.
    """
    try:
        from hypothesis.internal import observability
    except ImportError:  # pragma: no cover - depends on the Hypothesis version
        yield
        return
    before = getattr(observability, "OBSERVABILITY_COLLECT_COVERAGE", None)
    observability.OBSERVABILITY_COLLECT_COVERAGE = False
    try:
        yield
    finally:
        observability.OBSERVABILITY_COLLECT_COVERAGE = before


@contextlib.contextmanager
def no_local_constants() -> Iterator[None]:
    """Hypothesis draws no constants from the code around it while inside.

    Now and then (one integer draw in 20) Hypothesis draws a constant instead:
    from its own fixed list, or from the literals of every module imported
    at the time that it counts as local (not under site-packages, not a test
    file): the cache owner's package, tqbatch where it runs from a checkout,
    a script. Which modules those are depends on how things are installed and
    on what the process has imported, so a derandomized campaign drew other
    examples in another project, or after a new literal anywhere local
    (docs/search-speed.md). Inside, that pool is empty and the fixed list
    remains: the examples depend on the seed, the Hypothesis version and the
    harness alone. The draws Hypothesis makes are unchanged in number, so
    nothing else moves. Constant lists cached outside are cleared on the way
    in and out.
    """
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - depends on the Hypothesis version
        yield
        return
    cache = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)
    if not hasattr(providers, "_get_local_constants") or cache is None:
        yield  # pragma: no cover - a Hypothesis without local constants
        return
    empty = providers.Constants()
    cache.clear()
    try:
        with mock.patch.object(providers, "_get_local_constants", lambda: empty):
            yield
    finally:
        cache.clear()


def run_machine(
    machine: type, round_settings: settings, key: bytes, *, simplest: bool = True
) -> None:
    """``run_state_machine_as_test(machine)``, saving examples under the database key ``key``.

    Hypothesis would key them by a digest of the machine class (the same
    ``Counting`` for every target, so every target's campaign would replay
    every other's) and of its own state-machine runner's source, which
    changes with its version, and of the class's source, which Python
    versions read differently for a local class: a nightly and a pull
    request on other versions would never share a find. An explicit key is
    what Hypothesis's own ``find`` sets.

    Hypothesis still digests the class at every call, reading its source
    (for a class defined in a function, a parse of its whole module: 12 ms
    a round here); campaigns run classes of one definition round after round,
    so the digest is taken once per definition (``_digest_once``): the same bytes.

    Hypothesis's pool of constants from local code is left empty
    (``no_local_constants``): what a campaign draws does not depend on where it runs.

    ``simplest=False``: the engine's first example, every choice its simplest,
    is not run (``_without_simplest_example``); it is the same whatever the
    seed, so a campaign that runs one Hypothesis run per round of 5 examples
    would otherwise spend a fifth of its budget repeating it.
    """
    with _digest_once(machine):
        test = get_state_machine_test(machine, settings=round_settings)
    test._hypothesis_internal_database_key = key
    with (
        no_local_constants(),
        contextlib.nullcontext() if simplest else _without_simplest_example(),
    ):
        test()


@contextlib.contextmanager
def _without_simplest_example() -> Iterator[None]:
    """While inside, the engine's simplest example comes back as an overrun, unrun.

    The engine runs it first (``generate_new_test_cases``), and an overrun
    there only raises the ``large_base_example`` health check, which campaigns
    suppress; generation then goes on from random choices as it does after it.
    Rejecting the example from the test instead would not do: rejected before
    its first choice, it tells the engine every example is rejected.
    """
    try:
        from hypothesis.internal.conjecture.choice import ChoiceTemplate
        from hypothesis.internal.conjecture.data import Overrun
        from hypothesis.internal.conjecture.engine import ConjectureRunner
    except ImportError:  # pragma: no cover - depends on the Hypothesis version
        yield
        return
    simplest = (ChoiceTemplate("simplest", count=None),)
    original = ConjectureRunner.cached_test_function

    def cached_test_function(self, choices, *args, **kwargs):
        if tuple(choices) == simplest:
            return Overrun
        return original(self, choices, *args, **kwargs)

    with mock.patch.object(ConjectureRunner, "cached_test_function", cached_test_function):
        yield


# (module, qualified name) -> digest. A campaign makes its machine class anew
# (``machine_for``), but the digest reads only the class's source and signature,
# which its definition fixes: one parse per definition and process.
_DIGESTS: dict[tuple[str, str], bytes] = {}


@contextlib.contextmanager
def _digest_once(machine: type) -> Iterator[None]:
    """``hypothesis.stateful.function_digest(machine)`` computed once per class definition,
    while inside."""
    original = getattr(hypothesis.stateful, "function_digest", None)
    if original is None:  # pragma: no cover - depends on the Hypothesis version
        yield
        return
    definition = (machine.__module__, machine.__qualname__)

    def digest(function):
        if function is not machine:
            return original(function)
        if definition not in _DIGESTS:
            _DIGESTS[definition] = original(machine)
        return _DIGESTS[definition]

    with mock.patch.object(hypothesis.stateful, "function_digest", digest):
        yield


def replaying_final() -> bool:
    """Whether Hypothesis is replaying its shrunk example (the final run of a failure)."""
    return currently_in_test_context() and current_build_context().is_final
