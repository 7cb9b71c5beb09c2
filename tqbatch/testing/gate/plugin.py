"""tqbatch's pytest plugin: the conformance harness in a cache owner's own test run.

Installed with tqbatch (the ``pytest11`` entry point ``tqbatch``), so that in
any project::

    pip install 'tqbatch[harness]'
    python -m pytest --pyargs tqbatch.conformance --tqbatch-impl mypkg.cache:MyCache

runs the tests of ``tqbatch.conformance`` against the cache as ordinary
pytest tests (``--junitxml``, ``-k``, pytest-xdist all apply): each case of
the bad-input catalogue, each golden scenario shipped with tqbatch, a survey
of the state machine and, with ``--tqbatch-models``, the model-family matrix.

Options (``python -m pytest --help``, group "tqbatch"): ``--tqbatch-impl``
(ini ``tqbatch_impl``, else ``$TQBATCH_IMPL``, else tqbatch's own class),
``--tqbatch-examples`` (ini ``tqbatch_examples``; default: the Hypothesis
profile's ``max_examples``), ``--tqbatch-seed``, ``--tqbatch-survey-processes``
(default 2: the survey's examples spread over two processes),
``--tqbatch-known-failures FILE`` (ini ``tqbatch_known_failures``),
``--tqbatch-strict-known-failures``, ``--tqbatch-failures DIR`` (where new
failures are saved as scenarios), ``--tqbatch-oracles-only``,
``--tqbatch-models``, ``--tqbatch-precision`` and ``--tqbatch-device``.

The plugin stays out of a run that does not ask for it, since it is loaded
in every pytest run of an environment that has tqbatch: MLX's precision, the
device and the backend's known-answer check (``tqbatch.testing.backend``; a
backend that fails it ends the run with exit code 3, as the CLI does) are set
up only where ``tqbatch.conformance`` is named on the command line (or in
``addopts``), a ``--tqbatch-*`` option is given, conformance tests are
collected, or a conftest calls ``activate`` (tqbatch's own root conftest
does, for its suite). Hypothesis's global profile is left alone: the
profiles of ``tqbatch.testing.search.profiles`` are registered, and the survey
takes its steps per example from ``--hypothesis-profile``, else ``ci`` where
``CI`` is set, else ``dev``.

Known failures (``tqbatch.testing.gate.known_failures``): each failure the tests
find has an identity (``check@op``, ``tqbatch.testing.contract.checks``). A test whose
failures are all listed is an expected failure (xfail, with the file's
reasons); a failure not listed fails its test, with its identity and a
scenario file that ``tqbatch replay FILE`` reproduces (against the target
it was found on). A test that
was expected to show a listed failure and did not is reported as XPASS
(``--tqbatch-strict-known-failures``: it fails), and the terminal summary
lists every listed failure that no test found.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tqbatch.testing import backend
from tqbatch.testing.backend import lane
from tqbatch.testing.gate.session import (
    CONFORMANCE,
    EXPECTED,
    EXPECTS,
    FOUND,
    MODULES,
    Harness,
    expected_failures,
)

__all__ = ["NAME", "activate", "harness"]

# Two, whatever the machine: the survey's examples depend on the number (each
# process draws under its own seed), and a verdict must not depend on the
# runner's cores. GitHub's hosted runners have 3 (macOS arm64) or 4 (Linux).
SURVEY_PROCESSES = 2
# Once the survey has found a contract failure, it stops after this many
# rounds in a row find no new failing check, and at the latest after twice its
# first find's round plus this many (``campaign.quiet_stop_round``): a failing
# cache's job goes red soon after its last find, a correct one's runs the
# whole budget. Not tuned: 6 is what the timings of the mutants and of the
# mlx-vlm regressions were measured with (docs/search-speed.md, "A survey that
# ends soon after its last find").
QUIET_ROUNDS = 6

NAME = "tqbatch"  # the entry point's name: `-p no:tqbatch` turns the plugin off


_HARNESS = pytest.StashKey[Harness]()
_ACTIVE = pytest.StashKey[bool]()
_PENDING_ERROR = pytest.StashKey[str]()
_DEVICE = pytest.StashKey[str]()


# ---------------------------------------------------------------- options


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(NAME, "tqbatch conformance (pytest --pyargs tqbatch.conformance)")
    group.addoption(
        "--tqbatch-impl",
        metavar="MODULE:CLASS",
        default=None,
        help="cache under test (default: ini tqbatch_impl, else $TQBATCH_IMPL, else "
        "tqbatch.BatchTurboQuantKVCache)",
    )
    parser.addini("tqbatch_impl", "cache under test, MODULE:CLASS (see --tqbatch-impl)")
    group.addoption(
        "--tqbatch-examples",
        type=int,
        default=None,
        metavar="N",
        help="examples the state machine survey generates (default: ini tqbatch_examples, "
        "else the Hypothesis profile's max_examples: ci 300, dev 15)",
    )
    parser.addini("tqbatch_examples", "examples of the state machine survey (--tqbatch-examples)")
    group.addoption(
        "--tqbatch-seed", type=int, default=0, metavar="N", help="survey seed (default 0)"
    )
    group.addoption(
        "--tqbatch-survey-processes",
        type=int,
        default=SURVEY_PROCESSES,
        metavar="N",
        help=f"processes the survey's examples are spread over (default {SURVEY_PROCESSES}; 1: "
        "in the test's own process). Each runs its share under its own seed, so the examples "
        "depend on N, never on the machine",
    )
    group.addoption(
        "--tqbatch-quiet-rounds",
        type=int,
        default=QUIET_ROUNDS,
        metavar="N",
        help="once the survey has found a contract failure, it stops after N rounds in a row "
        f"(5 examples each, added up over its processes) find no new one, and at the latest "
        f"after twice its first find's round plus N (default {QUIET_ROUNDS}; 0: it runs its "
        "whole budget). A survey that finds none always runs its whole budget",
    )
    group.addoption(
        "--tqbatch-known-failures",
        metavar="FILE",
        default=None,
        help="failures the cache is known to have (tqbatch.testing.gate.known_failures' format; or "
        "the name of a list tqbatch ships, e.g. mlx_vlm_0_7_10): reported as xfail with their "
        "reasons; a failure not listed fails",
    )
    parser.addini(
        "tqbatch_known_failures",
        "known-failures file, relative to the ini file (see --tqbatch-known-failures)",
    )
    group.addoption(
        "--tqbatch-strict-known-failures",
        action="store_true",
        help="a test expected to show a listed failure that no longer fails, fails (XPASS strict)",
    )
    group.addoption(
        "--tqbatch-failures",
        metavar="DIR",
        default="tqbatch-failures",
        help="where each new failure is saved as a scenario, for tqbatch replay "
        "(default: ./tqbatch-failures)",
    )
    group.addoption(
        "--tqbatch-oracles-only",
        action="store_true",
        help="replay the golden scenarios against the live oracles only, not their recordings",
    )
    group.addoption(
        "--tqbatch-models",
        action="store_true",
        help="also run the model-family matrix (the cache inside nine mlx-vlm model families)",
    )
    group.addoption(
        "--tqbatch-precision",
        choices=backend.PRECISIONS,
        default=None,
        help="float32 matmul precision (default: $TQBATCH_PRECISION, else float32)",
    )
    group.addoption(
        "--tqbatch-device",
        choices=backend.DEVICES,
        default=None,
        help="MLX default device (default: $TQBATCH_DEVICE, else MLX's own default)",
    )


# ---------------------------------------------------------------- activation


def _names_conformance(arg: str) -> bool:
    target = arg.split("::", 1)[0]
    if target == CONFORMANCE or target.startswith(CONFORMANCE + "."):
        return True
    # A path to the package or one of its modules (in a checkout or an install).
    path = target.replace(os.sep, "/").rstrip("/")
    return path.endswith("tqbatch/conformance") or "tqbatch/conformance/" in path


def _asks_for_harness(args) -> bool:
    return any(
        isinstance(a, str) and (a.startswith("--tqbatch-") or _names_conformance(a)) for a in args
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser, args) -> None:
    # Before conftests (which may import mlx) are imported: MLX reads its
    # precision setting once.
    if not _asks_for_harness(args):
        return
    early_config.stash[_ACTIVE] = True
    try:
        backend.select_precision(early_config.known_args_namespace.tqbatch_precision)
    except (backend.BackendError, ValueError) as exc:
        early_config.stash[_PENDING_ERROR] = str(exc)


def activate(
    config: pytest.Config,
    *,
    impl: str | None = None,
    precision: str | None = None,
    device: str | None = None,
) -> Harness:
    """Set the harness up for this session: precision now, device and backend check at its start.

    For a conftest whose suite runs the harness (tqbatch's root conftest);
    ``impl``, ``precision`` and ``device`` are what its own options asked for
    (the plugin's ``--tqbatch-*`` options win where both are given).
    """
    config.stash[_ACTIVE] = True
    state = harness(config)
    if impl and not config.getoption("--tqbatch-impl"):
        state.impl_spec = impl
        os.environ["TQBATCH_IMPL"] = impl  # one source of truth for the target
    try:
        backend.select_precision(config.getoption("--tqbatch-precision") or precision)
    except (backend.BackendError, ValueError) as exc:
        config.stash[_PENDING_ERROR] = str(exc)
    if device and not config.getoption("--tqbatch-device"):
        config.stash[_DEVICE] = device
    return state


def harness(config: pytest.Config) -> Harness:
    """The session's ``Harness`` (built from the options on first use)."""
    state = config.stash.get(_HARNESS, None)
    if state is None:
        state = _harness_from_options(config)
        config.stash[_HARNESS] = state
    return state


def _ini(config: pytest.Config, name: str) -> str | None:
    value = config.getini(name)
    return str(value).strip() or None if value else None


def _harness_from_options(config: pytest.Config) -> Harness:
    invocation = Path(config.invocation_params.dir)
    examples = config.getoption("--tqbatch-examples")
    if examples is None and _ini(config, "tqbatch_examples"):
        try:
            examples = int(_ini(config, "tqbatch_examples"))
        except ValueError:
            raise pytest.UsageError(
                f"tqbatch: ini tqbatch_examples = {_ini(config, 'tqbatch_examples')!r}: "
                "expected a number"
            ) from None
    if examples is not None and examples < 1:
        raise pytest.UsageError("tqbatch: --tqbatch-examples must be positive")
    processes = config.getoption("--tqbatch-survey-processes")
    if processes < 1:
        raise pytest.UsageError("tqbatch: --tqbatch-survey-processes must be positive")
    quiet_rounds = config.getoption("--tqbatch-quiet-rounds")
    if quiet_rounds < 0:
        raise pytest.UsageError("tqbatch: --tqbatch-quiet-rounds must be 0 or more")
    failures = Path(config.getoption("--tqbatch-failures"))
    state = Harness(
        impl_spec=config.getoption("--tqbatch-impl") or _ini(config, "tqbatch_impl"),
        examples=examples,
        seed=config.getoption("--tqbatch-seed"),
        survey_processes=processes,
        quiet_rounds=quiet_rounds,
        profile=_profile(config),
        strict=config.getoption("--tqbatch-strict-known-failures"),
        models=config.getoption("--tqbatch-models"),
        oracles_only=config.getoption("--tqbatch-oracles-only"),
        failures_dir=failures if failures.is_absolute() else invocation / failures,
        invocation_dir=invocation,
    )
    name, base = config.getoption("--tqbatch-known-failures"), invocation
    if not name and _ini(config, "tqbatch_known_failures"):
        name = _ini(config, "tqbatch_known_failures")
        base = config.inipath.parent if config.inipath else config.rootpath
    if name:
        from tqbatch.testing.gate.known_failures import KnownFailures, KnownFailuresError, shipped

        path = base / name
        if not path.is_file() and shipped(name) is not None:
            path = shipped(name)  # the name of a list tqbatch ships, e.g. mlx_vlm_0_7_10
        try:
            state.known = KnownFailures.load(path)
        except KnownFailuresError as exc:
            raise pytest.UsageError(f"tqbatch: {exc}") from None
        state.known_path = path
    return state


def _profile(config: pytest.Config) -> str:
    """The Hypothesis profile of the survey: ``--hypothesis-profile``, else ci / dev by ``CI``."""
    chosen = config.getoption("--hypothesis-profile", None)
    if chosen:
        return chosen
    try:
        from tqbatch.testing.search.profiles import default_profile
    except ImportError:  # no Hypothesis: the survey reports the missing extra itself
        return "dev"
    return default_profile()


# ---------------------------------------------------------------- session


@pytest.hookimpl(tryfirst=True)  # before Hypothesis's plugin loads --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{EXPECTS}(which): the listed known failures a conformance test is expected to show "
        "(tqbatch.testing.gate.session.expected_failures)",
    )
    config.pluginmanager.register(_Summary(config), f"{NAME}-summary")
    try:
        from tqbatch.testing.search.profiles import register_profiles
    except ImportError:  # the harness extra is missing: nothing to register
        pass
    else:
        # Registered, not loaded: `--hypothesis-profile ci` (and the survey)
        # find tqbatch's; the global default stays the project's own.
        register_profiles()
    if config.stash.get(_ACTIVE, False):
        state = harness(config)
        if state.impl_spec:
            os.environ["TQBATCH_IMPL"] = state.impl_spec


def _check_backend(config: pytest.Config) -> None:
    """Device and known-answer check; a backend that fails it ends the run with exit code 3."""
    state = harness(config)
    if state.checked:
        return
    pending = config.stash.get(_PENDING_ERROR, None)
    if pending:
        pytest.exit(f"tqbatch: {pending}", returncode=3)
    try:
        backend.select_device(
            config.getoption("--tqbatch-device") or config.stash.get(_DEVICE, None)
        )
        state.backend = backend.check_backend()
    except (backend.BackendError, ValueError) as exc:
        # Cache verdicts on a backend that gets known answers wrong would be noise.
        pytest.exit(f"tqbatch: {exc}", returncode=3)
    state.checked = True


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.stash.get(_ACTIVE, False):
        _check_backend(session.config)


def _is_conformance(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return str(getattr(module, "__name__", "")).startswith(CONFORMANCE + ".")


def _conformance_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "conformance"


def pytest_collect_file(file_path: Path, parent):
    """The conformance modules, where the project's ``python_files`` would not collect them."""
    if not file_path.name.startswith("test_") or file_path.suffix != ".py":
        return None
    if file_path.resolve().parent != _conformance_dir():
        return None
    import fnmatch

    patterns = parent.config.getini("python_files")
    if any(fnmatch.fnmatch(file_path.name, p) for p in patterns):
        return None  # pytest's own collection takes it
    return pytest.Module.from_parent(parent, path=file_path)


@pytest.fixture(scope="session")
def tqbatch_harness(request) -> Harness:
    """The session's ``Harness``, its target loaded: what the conformance tests run against."""
    state = harness(request.config)
    if state.impl is None:
        from tqbatch.testing.target import load_impl

        state.impl = load_impl(state.impl_spec)
    return state


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    slots = [i for i, item in enumerate(items) if _is_conformance(item)]
    if not slots:
        return
    # The fast, deterministic tests first: a broken cache fails within seconds.
    order = {name: rank for rank, name in enumerate(MODULES)}
    ours = sorted(
        (items[i] for i in slots),
        key=lambda item: order.get(item.module.__name__.rpartition(".")[2], len(order)),
    )
    for i, item in zip(slots, ours):
        items[i] = item
    if not config.stash.get(_ACTIVE, False):
        # Collected without being named (e.g. through testpaths): set up now.
        config.stash[_ACTIVE] = True
        try:
            backend.select_precision(config.getoption("--tqbatch-precision"))
        except (backend.BackendError, ValueError) as exc:
            config.stash[_PENDING_ERROR] = str(exc)
        _check_backend(config)
    state = harness(config)
    if state.impl is None:
        from tqbatch.testing.target import ImplSpecError, load_impl

        try:
            state.impl = load_impl(state.impl_spec)
        except ImplSpecError as exc:
            raise pytest.UsageError(f"tqbatch: {exc}") from None
    listed = state.listed
    if not listed:
        return
    for item in ours:
        expected = expected_failures(item, listed)
        if expected:
            # Only an xfail the test itself raises (its failures all listed)
            # counts: any other failure fails it; no failure at all is XPASS.
            item.add_marker(
                pytest.mark.xfail(
                    reason="listed in the known failures: "
                    + "; ".join(f"{i} ({listed[i]})" for i in expected),
                    raises=pytest.xfail.Exception,
                    strict=state.strict,
                )
            )
            for identity in expected:
                item.user_properties.append((EXPECTED, identity))


def pytest_report_header(config: pytest.Config):
    state = config.stash.get(_HARNESS, None)
    if state is None or not state.backend:
        return None
    from tqbatch.testing.target import DEFAULT_IMPL, ENV_VAR

    target = state.impl_spec or os.environ.get(ENV_VAR) or DEFAULT_IMPL
    lines = [
        f"tqbatch backend: {backend.describe_line(state.backend)}",
        f"tqbatch target: {target}",
    ]
    if state.known_path:
        lines.append(f"tqbatch known failures: {state.known_path} ({len(state.listed)} listed)")
    return lines


# ---------------------------------------------------------------- summary


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The lane the session ran on and the custom kernels it launched, counted by name."""
    state = config.stash.get(_HARNESS, None)
    if state is None or not state.backend:
        return
    info = lane.describe()
    launched = ", ".join(f"{name} x{n}" for name, n in info["kernels_launched"].items())
    terminalreporter.write_line(
        f"tqbatch lane: {info['lane']} (mlx-vlm: {info['mlx_vlm_metal']}); custom kernels "
        f"launched in this process: {launched or 'none'}"
    )


class _Summary:
    """Gathers what the conformance tests found, for the terminal summary.

    Reads the tests' user properties from their reports, so that on
    pytest-xdist's controller it sees every worker's tests.
    """

    def __init__(self, config: pytest.Config):
        self.config = config
        self.found: dict[str, str] = {}  # identity -> the first test that found it
        self.expected: set[str] = set()  # listed identities of tests that ran

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        ran = not report.skipped or hasattr(report, "wasxfail")  # not a test that skipped
        for key, value in report.user_properties:
            if key == FOUND:
                self.found.setdefault(value, report.nodeid)
            elif key == EXPECTED and ran:
                self.expected.add(value)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        state = self.config.stash.get(_HARNESS, None)
        if state is None or not state.listed or not (self.found or self.expected):
            return
        listed = state.listed
        known = [i for i in self.found if i in listed]
        missing = sorted(i for i in self.expected if i not in self.found)
        tr = terminalreporter
        tr.section("tqbatch known failures")
        tr.line(f"{state.known_path}: {len(listed)} listed")
        for identity in known:
            tr.line(f"  still failing (xfail): {identity}  # {listed[identity]}")
        for identity in missing:
            tr.line(
                f"  listed, not found by the tests that should show it: {identity}  "
                f"# {listed[identity]} (fixed? remove it from {state.known_path}; a survey "
                "may also not reach it within its budget)",
                yellow=True,
            )
        unreached = sorted(i for i in listed if i not in self.found and i not in self.expected)
        if unreached:
            tr.line(f"  not checked by the tests that ran: {', '.join(unreached)}")
