"""The exit codes of every ``tqbatch`` command: one map, so that CI can tell outcomes apart.

- 0 ``OK``: everything checked passed.
- 1 ``DEFECT``: the target (the cache under test) has a defect.
- 2 ``USAGE``: a usage error, or a target that does not load (a bad ``--impl``).
- 3 ``BACKEND``: the backend failed its known-answer check
  (``tqbatch.testing.backend``): no verdict is possible.
- 4 ``NO_HARNESS``: the harness is not installed (a package of the
  ``harness`` extra is missing).
- 5 ``NOTHING_CHECKED``: the run checked nothing (every scenario skipped,
  no example run, every cell not applicable), so it has no verdict; as
  pytest's 5, "no tests collected". A CI step decides whether that is
  acceptable.

Which command produces which code is in each command's docstring and in the
README's "Exit codes" table.
"""

from __future__ import annotations

import enum
import importlib.util

__all__ = ["HARNESS_EXTRA", "HARNESS_MODULES", "ExitCode", "harness_message", "missing_harness"]


class ExitCode(enum.IntEnum):
    OK = 0
    DEFECT = 1
    USAGE = 2
    BACKEND = 3
    NO_HARNESS = 4
    NOTHING_CHECKED = 5

    @property
    def meaning(self) -> str:
        """What the code says, in a few words (e.g. for a CI summary)."""
        return _MEANINGS[self]


_MEANINGS = {
    ExitCode.OK: "clean",
    ExitCode.DEFECT: "the target has a defect",
    ExitCode.USAGE: "usage error, or a target that does not load",
    ExitCode.BACKEND: "the backend failed its known-answer check",
    ExitCode.NO_HARNESS: "the harness extra is not installed",
    ExitCode.NOTHING_CHECKED: "nothing was checked",
}


HARNESS_EXTRA = "harness"
# Top-level modules of the harness extra's packages (pyproject.toml's
# [project.optional-dependencies] harness), each with the package that
# installs it, which is what the message names.
HARNESS_MODULES = {
    "hypothesis": "hypothesis",
    "_hypothesis_globals": "hypothesis",
    "pytest": "pytest",
    "_pytest": "pytest",
    "xdist": "pytest-xdist",
    "rich": "rich",
}


def missing_harness(exc: BaseException) -> str | None:
    """The harness package whose absence raised ``exc``, else None.

    None for anything else, including a harness package that is installed
    but lacks what was imported from it (a version or a bug, not a missing
    install): the caller re-raises those.
    """
    if not isinstance(exc, ImportError) or not exc.name:
        return None
    top = exc.name.partition(".")[0]
    package = HARNESS_MODULES.get(top)
    if package is None:
        return None
    try:
        installed = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):  # e.g. a module in sys.modules without a spec
        installed = True
    return None if installed else package


def harness_message(command: str | None, package: str) -> str:
    """The one line a command prints when the harness extra is not installed."""
    prog = f"tqbatch {command}" if command else "tqbatch"
    return (
        f"{prog}: needs the {HARNESS_EXTRA} extra (missing: {package}): "
        f"pip install 'tqbatch[{HARNESS_EXTRA}]'"
    )
