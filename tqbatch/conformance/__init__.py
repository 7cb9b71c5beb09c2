"""The conformance tests tqbatch's pytest plugin (``tqbatch.testing.gate.plugin``) runs on a cache.

    python -m pytest --pyargs tqbatch.conformance --tqbatch-impl mypkg.cache:MyCache

Against the cache under test, one module each:

- ``test_bad_input.py::test_bad_input[CASE]``: each case of the bad-input
  catalogue (``tqbatch.testing.contract.strategies.BAD_INPUT_ERRORS``) on a batch of
  three rows with tokens written: rejected with the documented error, the
  cache left exactly as it was, and still in lockstep with the oracles after
  a decode step.
- ``test_golden.py::test_golden[NAME]``: each golden scenario shipped with
  tqbatch (``tqbatch.testing.replay.golden``), replayed against the live oracles
  and its recording (``--tqbatch-oracles-only``: the oracles alone).
- ``test_state_machine.py::test_state_machine``: a survey of the Hypothesis
  state machine (``tqbatch.testing.search.campaign``, as ``tqbatch fuzz --survey``):
  every distinct failing check, each shrunk within the run-counted bound
  (``SHRINK_RUNS``) and then op by op, so that a failure is reported as
  soon as on the command line, at any machine speed.
- ``test_models.py::test_model_family[FAMILY-SCENARIO]``
  (``--tqbatch-models``): the cache inside mlx-vlm's own model code
  (``tqbatch.workbench.model_matrix``); it must pass wherever mlx-lm's
  ``BatchKVCache`` passes.

They run in that order (the plugin sorts them), the fast, deterministic
ones first, so that a broken cache fails within seconds. Each failure a test
finds has an identity (``check@op``, ``tqbatch.testing.contract.checks``). One listed
in the known failures makes the test an expected failure (xfail, with the
listed reason); one not listed fails it, naming the identity and, where
there is an op sequence to replay, a scenario file saved under
``--tqbatch-failures`` with the command that reproduces it. A policy
difference (a cache may have another legal policy: ``tqbatch.testing.contract.checks``)
does not fail a test: it is an xfail saying so, as ``tqbatch conformance``
lists it without failing. Failures of the model matrix, and golden
divergences from a recording rather than from a check, have no identity:
they fail whatever is listed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tqbatch.testing.gate import plugin

__all__ = ["MODULES", "Found", "expected_failures", "failing", "judge", "options", "repro", "spec"]

# The modules in the order their tests run: fast and deterministic first.
MODULES = ("test_bad_input", "test_golden", "test_state_machine", "test_models")


@dataclass
class Found:
    """One failure a test found: its identity ("" where it has none), level and what failed."""

    identity: str
    level: str
    what: str
    ops: int | None = None
    repro: str | None = None  # the command that reproduces it

    def line(self) -> str:
        ops = f", {self.ops} ops" if self.ops is not None else ""
        head = f"{self.identity or '(no identity)'} [{self.level}{ops}]: "
        text = head + (self.what.splitlines()[0] if self.what else "")
        return text + (f"\n    reproduce: {self.repro}" if self.repro else "")


def expected_failures(item: pytest.Item, listed) -> list[str]:
    """The listed identities ``item`` is expected to show (the plugin marks it xfail for them).

    A bad-input case's test: the listed failures of that case (``check@CASE``).
    The survey: every other listed failure (standing checks and ``check@op``).
    Golden and model tests expect none: a scenario shows whatever fails first.
    """
    from tqbatch.testing.contract.strategies import BAD_INPUT_ERRORS

    name = getattr(item, "originalname", None) or item.name
    if name == "test_bad_input":
        case = item.callspec.params["case"]
        return [i for i in listed if i.partition("@")[2] == case]
    if name == "test_state_machine":
        return [i for i in listed if i.partition("@")[2] not in BAD_INPUT_ERRORS]
    return []


def spec(state: plugin.Harness) -> str:
    """The target as ``module:Class``."""
    from tqbatch.testing.target import impl_spec

    return impl_spec(state.impl)


def repro(state: plugin.Harness, path) -> str:
    """The command that replays the scenario at ``path`` against the target.

    No ``--impl``: the scenario records the target it was found on, and
    ``tqbatch replay`` replays it against that one.
    """
    return f"tqbatch replay {state.shown(path)}"


def options(request, state: plugin.Harness, **extra) -> dict:
    """The run's options, saved with a failure's scenario (``found_on.options``)."""
    return {
        "impl": spec(state),
        "runner": f"pytest --pyargs {plugin.CONFORMANCE}",
        "test": request.node.nodeid,
        **extra,
    }


def _listed(state: plugin.Harness, found: Found) -> bool:
    return bool(found.identity) and found.identity in state.listed


def failing(state: plugin.Harness, found: list[Found]) -> list[Found]:
    """What fails a test: failures not listed, but for policy differences."""
    return [f for f in found if not _listed(state, f) and f.level != "policy"]


def judge(request, state: plugin.Harness, found: list[Found], note: str = "") -> None:
    """Fail on what is new; xfail where everything found is listed or a policy difference.

    ``note`` ends the xfail reason (a golden test's construction of its batches).
    """
    for f in found:
        if f.identity:
            request.node.user_properties.append((plugin.FOUND, f.identity))
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
