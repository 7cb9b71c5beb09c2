"""tqbatch's pytest plugin from a project outside this checkout, as a cache's owner runs it.

A scratch project in a temporary directory, with its own ``pyproject.toml``
and a toy cache module (``toy.cache``: ``Toy``, tqbatch's cache as it is, and
``Broken``, which accepts ``trim(-1)`` instead of rejecting it; ``toy.vlm``:
mlx-vlm's class with a broken ``make_mask``, against the known-failures list
tqbatch ships for mlx-vlm 0.7.10). Its Python is
a venv made with ``--system-site-packages`` from the running interpreter,
whose own site-packages are put on the venv's path (mlx and the rest are not
installed again), and tqbatch is installed into it from a copy of this
checkout (``pip install --no-deps``, not editable: collecting the
conformance tests from this checkout would also load its root
``conftest.py``). Every command runs with the scratch project as its current
directory, as ``python -m pytest --pyargs tqbatch.conformance ...``.

Small budgets (``--tqbatch-examples``, the ``dev`` profile) and one survey
of the broken cache (it shrinks what it finds) keep it near two minutes on
two idle cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

import pytest

from tqbatch.testing.contract.ops import BAD_INPUT_ERRORS
from tqbatch.testing.replay import golden

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 600

pytestmark = pytest.mark.slow

TOY = '''\
"""A toy project's batch caches: one conforms, one has a planted bug."""

from tqbatch import BatchTurboQuantKVCache


class Toy(BatchTurboQuantKVCache):
    """tqbatch's cache as it is."""


class Broken(BatchTurboQuantKVCache):
    """Takes ``trim(-1)`` for "trim nothing", where the contract requires a ValueError."""

    def trim(self, n):
        if n < 0:
            return 0
        return super().trim(n)
'''

VLM = '''\
"""mlx-vlm's batch cache with one op broken, as a change under review might break it."""

from mlx_vlm.turboquant import BatchTurboQuantKVCache


class MaskIgnoresLeftPadding(BatchTurboQuantKVCache):
    """``make_mask`` as if no row were left-padded: a padded row attends its padding."""

    def make_mask(self, *args, **kwargs):
        padding = self.left_padding
        self.left_padding = padding * 0
        try:
            return super().make_mask(*args, **kwargs)
        finally:
            self.left_padding = padding
'''

# A server author's script: a tiny mlx-lm llama (random weights), the README's
# BatchGenerator block run as written (README_BLOCK, its first argument), then
# each request alone on single TurboQuant caches, greedy, for comparison.
SERVE = """\
import json
import sys

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

import tqbatch.mlx_lm

args = llama.ModelArgs(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
    vocab_size=256, tie_word_embeddings=False,
)
model = llama.Model(args)
model.load_weights([
    (name, mx.random.normal(p.shape, key=mx.random.key(i)) * p.shape[-1] ** -0.5)
    for i, (name, p) in enumerate(sorted(tree_flatten(model.parameters())))
])
prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]]
namespace = {"model": model, "prompts": prompts}
exec(open(sys.argv[1]).read(), namespace)


def alone(prompt, steps=8):
    caches = tqbatch.mlx_lm.make_prompt_cache(model, bits=4, seed=0)
    logits = model(mx.array([prompt]), cache=caches)[0, -1]
    out = []
    while len(out) < steps:
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[out[-1]]]), cache=caches)[0, -1]
    return out


batched = [namespace["tokens"][uid] for uid in namespace["uids"]]
print(json.dumps({
    "routed": tqbatch.mlx_lm.is_enabled(),
    "batched": batched,
    "alone": [alone(p) for p in prompts],
}))
"""

PYPROJECT = """\
[project]
name = "toy"
version = "0"

[tool.pytest.ini_options]
addopts = "-p no:cacheprovider"
tqbatch_impl = "toy.cache:Toy"
"""

# Makes the backend fail its known-answer check where TOY_BROKEN_BACKEND is
# set: fused attention returns zeros, as a broken GPU's kernels have.
CONFTEST = """\
import os

if os.environ.get("TOY_BROKEN_BACKEND"):
    import mlx.core as mx

    mx.fast.scaled_dot_product_attention = lambda q, k, v, **kw: mx.zeros(q.shape, dtype=q.dtype)
"""

KNOWN = """\
# toy.cache:Broken
rejects@trim-negative  # Broken takes trim(-1) for trim nothing; fixed in the next release
"""

PLUGIN = ["--pyargs", "tqbatch.conformance", "--hypothesis-profile", "dev"]
PLUGIN += ["--tqbatch-examples", "3"]


class Scratch:
    def __init__(self, project: Path, python: Path):
        self.project, self.python = project, python

    def run(self, *args: str, unset: tuple[str, ...] = (), **env: str):
        drop = {"PYTHONPATH", "TQBATCH_IMPL", "GITHUB_STEP_SUMMARY", "PYTEST_ADDOPTS", *unset}
        environment = {
            k: v
            for k, v in os.environ.items()
            if k not in drop and not k.startswith("PYTEST_XDIST")
        }
        environment.update(env)
        return subprocess.run(
            [str(self.python), *args],
            cwd=self.project,
            env=environment,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )

    def pytest(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return self.run("-m", "pytest", *PLUGIN, *args, **env)

    def tqbatch(self, *args: str) -> subprocess.CompletedProcess:
        """The ``tqbatch`` script pip installed, as a user types it (not ``python -m``)."""
        script = self.python.parent / "tqbatch"
        drop = {"PYTHONPATH", "TQBATCH_IMPL", "GITHUB_STEP_SUMMARY"}
        environment = {k: v for k, v in os.environ.items() if k not in drop}
        return subprocess.run(
            [str(script), *args],
            cwd=self.project,
            env=environment,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )


def _site_dirs() -> list[str]:
    """Where the running interpreter finds its packages: not its standard library (the venv
    has its own, and pip's isolated builds drop what a .pth adds), nor this checkout."""
    stdlib = {Path(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}

    def in_stdlib(path: Path) -> bool:
        inside = any(path == lib or lib in path.parents for lib in stdlib)
        return inside and not {"site-packages", "dist-packages"} & set(path.parts)

    return [
        p
        for p in sys.path
        if os.path.isabs(p)
        and os.path.isdir(p)
        and not in_stdlib(Path(p))
        and not os.path.exists(os.path.join(p, "tqbatch", "__init__.py"))
    ]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Scratch:
    base = tmp_path_factory.mktemp("plugin")
    project = base / "project"
    (project / "toy").mkdir(parents=True)
    (project / "toy" / "__init__.py").write_text("")
    (project / "toy" / "cache.py").write_text(TOY)
    (project / "toy" / "vlm.py").write_text(VLM)
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "conftest.py").write_text(CONFTEST)
    (project / "known-failures.txt").write_text(KNOWN)

    venv = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=TIMEOUT,
    )
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "running-interpreter.pth").write_text("\n".join(_site_dirs()) + "\n")

    # A copy of what the wheel is built from: building in the checkout would
    # leave build/ there.
    source = base / "tqbatch-src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "tqbatch", source / "tqbatch", ignore=shutil.ignore_patterns("__pycache__")
    )
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
    install += ["--quiet", "--disable-pip-version-check"]
    try:  # the project's build backend where it is here; else pip gets it, as for any user
        isolated = int(metadata.version("setuptools").split(".")[0]) < 77
    except metadata.PackageNotFoundError:
        isolated = True
    if not isolated:
        install.append("--no-build-isolation")
    subprocess.run([*install, str(source)], check=True, timeout=TIMEOUT)

    made = Scratch(project, python)
    where = made.run("-c", "import tqbatch; print(tqbatch.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the installed copy
    return made


def _junit(path: Path) -> dict[str, ET.Element]:
    return {case.get("name"): case for case in ET.parse(path).getroot().iter("testcase")}


def test_a_conforming_cache_passes_with_every_test_in_junit(scratch):
    run = scratch.pytest("--tqbatch-impl", "toy.cache:Toy", "-q", "--junitxml", "out.xml")
    assert run.returncode == 0, run.stdout + run.stderr
    cases = _junit(scratch.project / "out.xml")
    for name in (
        "test_bad_input[trim-negative]",
        "test_golden[22_long_lifecycle]",
        "test_state_machine",
    ):
        assert name in cases, sorted(cases)
    assert sum(n.startswith("test_bad_input[") for n in cases) == len(BAD_INPUT_ERRORS)
    # Every scenario the installed package ships, none skipped by collection.
    assert sum(n.startswith("test_golden[") for n in cases) == len(golden.paths())
    assert not [c for c in cases.values() if c.find("failure") is not None]
    assert not (scratch.project / "tqbatch-failures").exists()  # a green run leaves nothing


def test_the_ini_names_the_target_and_the_header_says_which(scratch):
    run = scratch.pytest("--collect-only", "-k", "state_machine")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tqbatch target: toy.cache:Toy" in run.stdout
    assert "tqbatch backend: mlx" in run.stdout


def test_a_broken_cache_fails_naming_the_failure_with_a_replayable_scenario(scratch):
    # Without the survey, which finds the same failure (and shrinks it: a
    # minute here); the next test runs it.
    run = scratch.pytest(
        "--tqbatch-impl", "toy.cache:Broken", "-q", "--junitxml", "broken.xml", "-k", "not state"
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "rejects@trim-negative [contract" in run.stdout
    failed = [
        name
        for name, case in _junit(scratch.project / "broken.xml").items()
        if case.find("failure") is not None
    ]
    assert "test_bad_input[trim-negative]" in failed, failed
    repro = re.search(r"reproduce: tqbatch replay (\S+\.json)", run.stdout)
    assert repro, run.stdout
    path = repro.group(1)
    assert (scratch.project / path).is_file() and path.startswith("tqbatch-failures")
    # The scenario reproduces the failure, against the class it was found on
    # without being told which; the cache without the bug replays it green.
    again = scratch.tqbatch("replay", path)
    assert again.returncode == 1, again.stdout + again.stderr
    assert "rejects" in again.stdout
    toy = ["--impl", "toy.cache:Toy", "--oracles-only"]
    fixed = scratch.run("-m", "tqbatch", "replay", *toy, path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_mlx_vlms_class_is_green_with_the_known_failures_tqbatch_ships(scratch):
    run = scratch.pytest(
        "--tqbatch-impl",
        "mlx-vlm",
        "--tqbatch-known-failures",
        "mlx_vlm_0_7_10",
        "-q",
        "--junitxml",
        "vlm.xml",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    cases = _junit(scratch.project / "vlm.xml")
    assert not [n for n, c in cases.items() if c.find("failure") is not None]
    xfailed = [n for n, c in cases.items() if c.find("skipped") is not None]
    assert "test_state_machine" in xfailed and len(xfailed) > 1, xfailed


def _golden_outcomes(cases: dict[str, ET.Element]) -> dict[str, tuple[str, str]]:
    """Each golden test's outcome (passed, xfailed, skipped, failed) and its message."""
    outcomes = {}
    for name, case in cases.items():
        if not name.startswith("test_golden["):
            continue
        failed, skipped = case.find("failure"), case.find("skipped")
        if failed is not None:
            outcomes[name] = ("failed", failed.get("message", ""))
        elif skipped is None:
            outcomes[name] = ("passed", "")
        elif skipped.get("type") == "pytest.xfail":
            outcomes[name] = ("xfailed", skipped.get("message", ""))
        else:
            outcomes[name] = ("skipped", skipped.get("message", ""))
    return outcomes


def test_the_golden_set_runs_against_mlx_vlms_class(scratch):
    """It has no merge: its batches are built by constructor and a padded prefill, and a
    golden skips only where an op is missing (prepare, finalize) or tests merge itself."""
    run = scratch.pytest(
        "--tqbatch-impl",
        "mlx-vlm",
        "--tqbatch-known-failures",
        "mlx_vlm_0_7_10",
        "-k",
        "golden",
        "-q",
        "--junitxml",
        "vlm-golden.xml",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    outcomes = _golden_outcomes(_junit(scratch.project / "vlm-golden.xml"))
    assert len(outcomes) == len(golden.paths())
    by_kind: dict[str, list[str]] = {}
    for name, (kind, _) in outcomes.items():
        by_kind.setdefault(kind, []).append(name)
    # Measured against mlx-vlm 0.7.10 with its shipped list: 12 pass; 12 xfail on a
    # listed failure of the ops they replay (offset@roundtrip: 07, 10, the eight 14s
    # and 24; dequantize@extend: 12's empty side); 8 skip.
    assert {k: len(v) for k, v in by_kind.items()} == {"passed": 12, "xfailed": 12, "skipped": 8}
    built = "built by constructor(left_padding) + padded prefill"
    for kind, message in outcomes.values():
        if kind == "skipped":
            missing_op = re.search(r"lacks what op\(s\) .*'(prepare|finalize)'", message)
            assert missing_op or "it has no merge, and" in message, message
        if kind == "xfailed":
            assert message.startswith(("offset@roundtrip", "dequantize@extend")), message
            assert built in message, message
    merge_only = [m for k, m in outcomes.values() if k == "skipped" and "no merge" in m]
    assert len(merge_only) == 3 and all(built in m for m in merge_only), merge_only


def test_a_defect_injected_into_mlx_vlms_class_is_red_with_a_repro_that_replays(scratch):
    # The shipped list covers mlx-vlm's own defects; the planted one is new.
    run = scratch.pytest(
        "--tqbatch-impl",
        "toy.vlm:MaskIgnoresLeftPadding",
        "--tqbatch-known-failures",
        "mlx_vlm_0_7_10",
        "-q",
        "-k",
        "state_machine",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "mask_values@new [contract" in run.stdout
    assert "known failures also found" in run.stdout  # mlx-vlm's own, still listed as known
    repro = re.search(r"mask_values@new .*\n\s+reproduce: tqbatch replay (\S+\.json)", run.stdout)
    assert repro, run.stdout
    again = scratch.tqbatch("replay", repro.group(1))
    assert again.returncode == 1, again.stdout + again.stderr
    assert "replaying against toy.vlm:MaskIgnoresLeftPadding" in again.stdout
    assert "[mask_values]" in again.stdout


@pytest.mark.float32_only(
    reason="greedy tokens batched vs alone: at TF32 forward noise can flip a code (as "
    "test_mlx_lm_route.py)"
)
def test_a_server_authors_readme_loop_runs_on_mlx_lms_llama_from_the_install(scratch):
    """The README's BatchGenerator block, run as written, with the installed tqbatch."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### With mlx-lm's `BatchGenerator`") :]
    (scratch.project / "readme_block.py").write_text(
        re.search(r"```python\n(.*?)```", section, re.S).group(1)
    )
    (scratch.project / "serve.py").write_text(SERVE)
    run = scratch.run("serve.py", "readme_block.py")
    assert run.returncode == 0, run.stdout + run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["routed"]
    # Greedy tokens of each request batched equal the request's alone (the
    # rows hold the same codes; only float32 summation order differs, far
    # below the logit margins of these prompts: see test_mlx_lm_route.py).
    assert out["batched"] == out["alone"], out
    assert [len(t) for t in out["batched"]] == [8, 8]


def test_a_listed_failure_is_an_xfail_with_its_reason(scratch):
    run = scratch.pytest(
        "--tqbatch-impl",
        "toy.cache:Broken",
        "--tqbatch-known-failures",
        "known-failures.txt",
        "-q",
        "-rx",
        "--junitxml",
        "known.xml",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "xfailed" in run.stdout and "fixed in the next release" in run.stdout
    cases = _junit(scratch.project / "known.xml")
    skipped = cases["test_bad_input[trim-negative]"].find("skipped")
    assert skipped is not None and skipped.get("type") == "pytest.xfail"
    assert "rejects@trim-negative" in skipped.get("message")
    # The survey finds it too, and judges it the same way.
    survey = cases["test_state_machine"]
    assert survey.find("failure") is None and survey.find("error") is None


def test_a_listed_failure_that_no_longer_fails_is_reported(scratch):
    run = scratch.pytest(
        "--tqbatch-impl",
        "toy.cache:Toy",
        "--tqbatch-known-failures",
        "known-failures.txt",
        "-q",
        "-rX",
        "-k",
        "trim-negative",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "XPASS" in run.stdout and "1 xpassed" in run.stdout
    assert "listed, not found by the tests that should show it: rejects@trim-negative" in (
        run.stdout
    )
    strict = scratch.pytest(
        "--tqbatch-impl",
        "toy.cache:Toy",
        "--tqbatch-known-failures",
        "known-failures.txt",
        "--tqbatch-strict-known-failures",
        "-q",
        "-k",
        "trim-negative",
    )
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "XPASS(strict)" in strict.stdout


def test_a_backend_that_fails_its_check_stops_the_run_with_exit_3(scratch):
    run = scratch.pytest("--tqbatch-impl", "toy.cache:Toy", "-q", TOY_BROKEN_BACKEND="1")
    assert run.returncode == 3, run.stdout + run.stderr
    assert "fused attention" in run.stdout + run.stderr


def test_the_plugin_stays_out_of_a_run_that_does_not_ask_for_it(scratch):
    (scratch.project / "tests").mkdir(exist_ok=True)
    (scratch.project / "tests" / "test_own.py").write_text(
        textwrap.dedent(
            """\
            import os
            import sys


            def test_own():
                assert "mlx.core" not in sys.modules  # no backend check, no mlx imported
                assert "MLX_ENABLE_TF32" not in os.environ  # the precision left alone
            """
        )
    )
    # This suite's own choice of precision is not inherited.
    run = scratch.run("-m", "pytest", "-q", "tests", unset=("MLX_ENABLE_TF32", "TQBATCH_PRECISION"))
    assert run.returncode == 0, run.stdout + run.stderr
