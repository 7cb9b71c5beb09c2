"""docs/ops.md's vocabulary section is the op modules' declarations, as written by
``python -m tqbatch.testing.contract.ops --write docs/ops.md``."""

from __future__ import annotations

from pathlib import Path

from tqbatch.testing.contract.ops import OPS
from tqbatch.testing.contract.ops.__main__ import render, vocabulary

OPS_MD = Path(__file__).resolve().parents[2] / "docs" / "ops.md"


def test_docs_ops_md_is_generated_from_the_op_modules():
    text = OPS_MD.read_text()
    assert text == render(text), (
        "docs/ops.md is out of date: run python -m tqbatch.testing.contract.ops --write docs/ops.md"
    )


def test_every_op_has_a_row_and_its_checks_listed():
    table = vocabulary()
    for op in OPS.values():
        assert f"| `{op.name}` | {op.fields} |" in table
        for check in op.checks:
            assert f"`{check.name}`" in table
