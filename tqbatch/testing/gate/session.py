"""The conformance session: what the tests of ``tqbatch.conformance`` run against, and how
each test turns what it found into its verdict.

The plugin (``tqbatch.testing.gate.plugin``) builds the session's ``Harness``
from its options and hands it to the tests (fixture ``tqbatch_harness``);
each test reports what it found as ``Failure`` records
(``tqbatch.testing.contract.failure``) and ends with
``conclude``: it fails on a failure not in the known failures, is an expected
failure (xfail) where everything found is listed or a policy difference, and
passes where nothing was found. Which listed failures a test is expected to
show is declared on the test with the marker ``tqbatch_expects`` (``EXPECTS``)
and read by ``expected_failures``; an unmarked test expects none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tqbatch.testing.contract.failure import Failure

__all__ = [
    "BY_CASE",
    "BY_OP",
    "CONFORMANCE",
    "EXPECTED",
    "EXPECTS",
    "FOUND",
    "MODULES",
    "Harness",
    "expected_failures",
    "failing",
    "conclude",
    "options",
    "repro",
    "spec",
]

CONFORMANCE = "tqbatch.conformance"
# The modules in the order their tests run: fast and deterministic first.
MODULES = ("test_bad_input", "test_golden", "test_state_machine", "test_models")
# Names of the user properties a conformance test records (also in JUnit XML).
FOUND = "tqbatch_found"  # an identity the test found failing
EXPECTED = "tqbatch_expected"  # a listed identity the test was expected to show
# The marker a conformance test declares the listed failures it may show with,
# and its arguments: those of the bad-input case its ``case`` parameter names
# (``check@CASE``), or those of an op or a standing check (every listed failure
# but the bad-input cases').
EXPECTS = "tqbatch_expects"
BY_CASE, BY_OP = "case", "op"


@dataclass(kw_only=True)
class Harness:
    """What the conformance tests run against, and with what, for one pytest session."""

    impl_spec: str | None = None  # None: $TQBATCH_IMPL, else tqbatch's own class
    examples: int | None = None  # None: the profile's max_examples
    seed: int = 0
    survey_processes: int  # the plugin's --tqbatch-survey-processes
    quiet_rounds: int  # --tqbatch-quiet-rounds; 0: the survey runs its whole budget
    profile: str = "dev"
    known: object | None = None  # a tqbatch.testing.gate.known_failures.KnownFailures
    known_path: Path | None = None
    strict: bool = False
    models: bool = False
    oracles_only: bool = False
    failures_dir: Path = field(default_factory=lambda: Path("tqbatch-failures"))
    invocation_dir: Path = field(default_factory=Path.cwd)
    backend: dict | None = None
    impl: type | None = None
    checked: bool = False  # the backend check ran (and passed)

    @property
    def listed(self) -> dict[str, str]:
        """The known failures, identity -> reason (empty without a file)."""
        return dict(getattr(self.known, "entries", None) or {})

    def shown(self, path: Path) -> str:
        """``path`` as a user at the invocation directory types it."""
        try:
            return str(Path(path).resolve().relative_to(self.invocation_dir.resolve()))
        except ValueError:
            return str(path)


def expected_failures(item: pytest.Item, listed) -> list[str]:
    """The listed identities ``item`` is expected to show (the plugin marks it xfail for them),
    as its ``tqbatch_expects`` marker declares; none for a test without one (a golden
    scenario or a model cell shows whatever fails first)."""
    marker = item.get_closest_marker(EXPECTS)
    if marker is None:
        return []
    (which,) = marker.args
    if which == BY_CASE:
        case = item.callspec.params["case"]
        return [i for i in listed if i.partition("@")[2] == case]
    if which == BY_OP:
        from tqbatch.testing.contract.ops import BAD_INPUT_ERRORS

        return [i for i in listed if i.partition("@")[2] not in BAD_INPUT_ERRORS]
    raise ValueError(f"{item.nodeid}: {EXPECTS}({which!r}): expected {BY_CASE!r} or {BY_OP!r}")


def spec(state: Harness) -> str:
    """The target as ``module:Class``."""
    from tqbatch.testing.target import impl_spec

    return impl_spec(state.impl)


def repro(state: Harness, path) -> str:
    """The command that replays the scenario at ``path`` against the target.

    No ``--impl``: the scenario records the target it was found on, and
    ``tqbatch replay`` replays it against that one.
    """
    return f"tqbatch replay {state.shown(path)}"


def options(request, state: Harness, **extra) -> dict:
    """The run's options, saved with a failure's scenario (``found_on.options``)."""
    return {
        "impl": spec(state),
        "runner": f"pytest --pyargs {CONFORMANCE}",
        "test": request.node.nodeid,
        **extra,
    }


def _listed(state: Harness, found: Failure) -> bool:
    return bool(found.identity) and found.identity in state.listed


def failing(state: Harness, found: list[Failure]) -> list[Failure]:
    """What fails a test: failures not listed, but for policy differences."""
    return [f for f in found if not _listed(state, f) and f.level != "policy"]


def conclude(request, state: Harness, found: list[Failure], note: str = "") -> None:
    """Fail on what is new; xfail where everything found is listed or a policy difference.

    ``note`` ends the xfail reason (a golden test's construction of its batches).
    """
    for f in found:
        if f.identity:
            request.node.user_properties.append((FOUND, f.identity))
    new = failing(state, found)
    known = [f for f in found if _listed(state, f)]
    policy = [f for f in found if not _listed(state, f) and f.level == "policy"]
    listed_in = f"listed in {state.known_path}" if state.known_path else "no known-failures file"
    if new:
        lines = [
            f"{spec(state)}: {len(new)} failure(s) not in the known failures ({listed_in}):",
            *(f"  {f.line()}" for f in new),
        ]
        if known:
            lines += ["known failures also found:", *(f"  {f.line()}" for f in known)]
        if policy:
            lines += ["policy differences also found:", *(f"  {f.line()}" for f in policy)]
        pytest.fail("\n".join(lines), pytrace=False)
    if known or policy:
        reasons = [f"{f.identity}: {state.listed[f.identity]}" for f in known]
        reasons += [f"{f.identity}: a policy difference, not a contract failure" for f in policy]
        pytest.xfail("; ".join(reasons) + note)
