"""Which part of tqbatch may import which: the import graph of the whole package.

Two rules, read from the source (nothing is imported):

* **No circle.** No module reaches itself through the imports of the
  package. Every static import counts, wherever it stands: at module level,
  inside a function, under ``if TYPE_CHECKING:``. A lazy import inside a
  function is still an arrow (it only hides the circle until run time), and
  a type-only one still ties the two modules' meanings. Not seen: a module
  loaded by a computed name (``importlib.import_module(f"...{name}")``, as
  the op registry loads its op modules). ``import a.b.c`` is an arrow to
  ``a.b.c`` alone (not to the packages ``a`` and ``a.b`` that Python runs
  on the way); ``from a.b import c`` an arrow to the module ``a.b.c`` where
  there is one, else to ``a.b``.
* **No arrow up.** The package is a stack of wings (``LAYERS``, bottom
  first): a module imports its own wing and the wings below, never a wing
  above nor a neighbour on its own floor.

The harness (``tqbatch.testing``) judges cache operations and builds no
language model: models, serving loops and the model-family matrix live in
the workbench (``tqbatch.workbench``), above it. Nor may the harness import a
model family's code (``mlx_lm.models.<family>``, ``mlx_vlm.models.<family>``);
their shared infrastructure (``cache``, ``base``) is not model code.

The last tests plant a circle and an arrow up in a package of their own and
show that the rules catch them.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tqbatch" / "testing"
# Modules of mlx-lm and mlx-vlm that hold caches and attention, not a model.
INFRASTRUCTURE = {"cache", "base"}
MODEL_CODE = re.compile(r"^mlx_(lm|vlm)\.models\.(\w+)")

T = "tqbatch.testing"
# The floors of tqbatch, bottom first; on each, its wings by name, each the
# modules and packages it holds. A module belongs to the wing with the longest
# name that is it or a package above it.
LAYERS: list[dict[str, tuple[str, ...]]] = [
    # The cache (everything of tqbatch not named on a floor above).
    {"cache": ("tqbatch",)},
    # The harness, from what it stands on to what a cache owner runs.
    {"target": (f"{T}.target",), "backend": (f"{T}.backend",)},
    {"harness": (T,)},  # the package's face: it takes the lane at import
    {"oracles": (f"{T}.oracles",)},
    {"contract": (f"{T}.contract",)},
    {"executor": (f"{T}.world", f"{T}.collector")},
    {"replay": (f"{T}.replay",)},
    {"search": (f"{T}.search",)},
    {"gate": (f"{T}.gate",), "selfcheck": (f"{T}.selfcheck", f"{T}.mutants")},
    # Language models, above the harness.
    {"workbench": ("tqbatch.workbench",)},
    # What a user runs: the plugin's tests, the CLI.
    {
        "conformance": ("tqbatch.conformance",),
        "cli": ("tqbatch.cli", "tqbatch.__main__", "tqbatch.commands"),
    },
]


# ------------------------------------------------------------ the graph


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name (a package by its own)."""
    found = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module of the package that importing ``name`` names: it, or the nearest package
    above it that is one (``a.b.attr`` is ``a.b``); None outside the package."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def arrows(root: Path, package: str) -> dict[str, dict[str, int]]:
    """Module -> the modules of the package it imports -> the line of the first such import."""
    known = modules(root, package)
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        targets: dict[str, int] = {}
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, path.name == "__init__.py", node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    names.append(sub if sub in known else base)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.append(arg.value)
            for name in names:
                target = _resolve(name, known)
                if target is not None and target != module:
                    targets.setdefault(target, node.lineno)
        graph[module] = targets
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def wing_of(module: str, layers) -> tuple[int, str] | None:
    """(floor, wing) of ``module``: the wing holding the longest name that covers it."""
    best = None
    for floor, wings in enumerate(layers):
        for wing, names in wings.items():
            for name in names:
                if module == name or module.startswith(name + "."):
                    if best is None or len(name) > best[0]:
                        best = (len(name), floor, wing)
    return None if best is None else best[1:]


def arrows_up(graph: dict[str, dict[str, int]], layers) -> list[str]:
    """Every import of a wing above, or of another wing on the same floor."""
    bad = []
    for module, targets in sorted(graph.items()):
        floor, wing = wing_of(module, layers)
        for target, line in sorted(targets.items()):
            their_floor, their_wing = wing_of(target, layers)
            if their_floor > floor or (their_floor == floor and their_wing != wing):
                bad.append(f"{module}:{line} ({wing}) imports {target} ({their_wing})")
    return bad


GRAPH = arrows(ROOT, "tqbatch")


def test_every_module_is_in_a_wing():
    # The harness's package face holds only itself: a module added to the
    # harness takes a wing (a folder, or a name on a floor of LAYERS).
    loose = [m for m in GRAPH if m.startswith(T + ".") and wing_of(m, LAYERS)[1] == "harness"]
    assert loose == [], f"modules of {T} in no wing of LAYERS: {loose}"


def test_no_circle():
    assert circles(GRAPH) == []


def test_no_arrow_up():
    assert arrows_up(GRAPH, LAYERS) == []


# ------------------------------------------------- the harness builds no model


def _imports(tree: ast.AST) -> list[str]:
    """Every module a file imports, and every string it hands ``import_module``."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            # "from mlx_lm.models import llama" imports the family module itself.
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.append(arg.value)
            elif isinstance(arg, ast.JoinedStr):  # f"mlx_lm.models.{name}": a family
                head = "".join(v.value for v in arg.values if isinstance(v, ast.Constant))
                names.append(head + "family")
    return names


def _violations(name: str) -> str | None:
    if name == "tqbatch.workbench" or name.startswith("tqbatch.workbench."):
        return "imports the workbench"
    found = MODEL_CODE.match(name)
    if found and found.group(2) not in INFRASTRUCTURE:
        return "imports model code"
    return None


HARNESS_FILES = sorted(HARNESS.rglob("*.py"))


@pytest.mark.parametrize(
    "path", HARNESS_FILES, ids=[str(p.relative_to(HARNESS)) for p in HARNESS_FILES]
)
def test_harness_module_imports_no_workbench_and_no_model(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad = [f"{name}: {why}" for name in _imports(tree) if (why := _violations(name))]
    assert bad == [], f"{path.relative_to(HARNESS.parents[1])}: {bad}"


@pytest.mark.parametrize(
    "source",
    [
        "from tqbatch.workbench import model_matrix",
        "import tqbatch.workbench.serving",
        "from mlx_lm.models import llama",
        "from mlx_vlm.models.qwen2 import language",
        "importlib.import_module(f'mlx_lm.models.{name}')",
    ],
)
def test_the_guard_sees_a_forbidden_import(source):
    assert any(_violations(n) for n in _imports(ast.parse(source)))


def test_the_guard_lets_infrastructure_through():
    source = "from mlx_lm.models.cache import KVCache\nfrom mlx_vlm.models import cache, base"
    assert not any(_violations(n) for n in _imports(ast.parse(source)))


# ------------------------------------------------- the rules catch a planted one

# A package of three floors: ``low``, then ``mid`` (the package ``mid`` and the
# module ``side``, neighbours), then ``high``. Each case adds one file or import.
PLANTED_LAYERS = [
    {"low": ("pkg", "pkg.low")},
    {"mid": ("pkg.mid",), "side": ("pkg.side",)},
    {"high": ("pkg.high",)},
]
CLEAN = {
    "pkg/__init__.py": "",
    "pkg/low.py": "X = 1\n",
    "pkg/mid/__init__.py": "",
    "pkg/mid/a.py": "from pkg.low import X\nfrom . import b\n",
    "pkg/mid/b.py": "import pkg.low\n",
    "pkg/side.py": "from pkg import low\n",
    "pkg/high.py": "from pkg.mid import a\nfrom pkg.side import *\n",
}


def _planted(tmp_path: Path, **changes: str) -> dict[str, dict[str, int]]:
    for name, text in {**CLEAN, **changes}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return arrows(tmp_path, "pkg")


def test_the_rules_pass_a_clean_package(tmp_path):
    graph = _planted(tmp_path)
    assert graph["pkg.mid.a"] == {"pkg.low": 1, "pkg.mid.b": 2}
    assert graph["pkg.high"] == {"pkg.mid.a": 1, "pkg.side": 2}
    assert circles(graph) == []
    assert arrows_up(graph, PLANTED_LAYERS) == []


TYPE_ONLY = """\
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .a import X
"""


@pytest.mark.parametrize(
    "changes, circle",
    [
        # A lazy import inside a function closes it all the same.
        ({"pkg/mid/b.py": "def f():\n    from pkg.mid import a\n"}, ["pkg.mid.a", "pkg.mid.b"]),
        # So does a type-only one.
        (
            {"pkg/mid/b.py": TYPE_ONLY},
            ["pkg.mid.a", "pkg.mid.b"],
        ),
        # Through a package's face: the face imports a, which imports the face.
        (
            {"pkg/mid/__init__.py": "from .a import X\n", "pkg/mid/a.py": "import pkg.mid\n"},
            ["pkg.mid", "pkg.mid.a"],
        ),
    ],
    ids=["lazy", "type-only", "package-face"],
)
def test_a_planted_circle_is_caught(tmp_path, changes, circle):
    assert circles(_planted(tmp_path, **changes)) == [circle]


@pytest.mark.parametrize(
    "changes, arrow",
    [
        (
            {"pkg/low.py": "def f():\n    import pkg.high\n"},
            "pkg.low:2 (low) imports pkg.high (high)",
        ),
        (
            {"pkg/mid/b.py": "from pkg.side import *\n"},
            "pkg.mid.b:1 (mid) imports pkg.side (side)",
        ),
        (
            {"pkg/low.py": "import importlib\nimportlib.import_module('pkg.mid.a')\n"},
            "pkg.low:2 (low) imports pkg.mid.a (mid)",
        ),
    ],
    ids=["up-a-floor", "neighbour", "import-module"],
)
def test_a_planted_arrow_up_is_caught(tmp_path, changes, arrow):
    assert arrows_up(_planted(tmp_path, **changes), PLANTED_LAYERS) == [arrow]
