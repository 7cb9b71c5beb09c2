"""The harness (``tqbatch.testing``) judges cache operations and builds no language model.

Models, serving loops and the model-family matrix live in the workbench
(``tqbatch.workbench``), which may use the harness; the harness must not use
the workbench or import a model family's code (``mlx_lm.models.<family>``,
``mlx_vlm.models.<family>``). Their shared infrastructure (``cache``, ``base``)
is not model code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "tqbatch" / "testing"
# Modules of mlx-lm and mlx-vlm that hold caches and attention, not a model.
INFRASTRUCTURE = {"cache", "base"}
MODEL_CODE = re.compile(r"^mlx_(lm|vlm)\.models\.(\w+)")


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


@pytest.mark.parametrize("path", HARNESS_FILES, ids=[p.name for p in HARNESS_FILES])
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
