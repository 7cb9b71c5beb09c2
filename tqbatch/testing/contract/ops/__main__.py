"""``python -m tqbatch.testing.contract.ops``: docs/ops.md's vocabulary, from the op modules.

Prints the section between docs/ops.md's ``<!-- ops:begin -->`` and
``<!-- ops:end -->`` markers (``--write`` replaces it in place): the table of
ops, the table of optional fields, each op's checks and bad-input cases, and
its notes. tests/unit/test_ops_doc.py holds the file to this output.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from tqbatch.testing.contract.ops import OPS

BEGIN, END = "<!-- ops:begin -->", "<!-- ops:end -->"


def vocabulary() -> str:
    """The generated section of docs/ops.md, markers excluded."""
    lines = ["| op | fields | meaning |", "|---|---|---|"]
    lines += [f"| `{op.name}` | {op.fields} | {op.meaning} |" for op in OPS.values()]
    lines += [
        "",
        "Every field below is optional; an op without it behaves as in the table above.",
        "",
        "| op | optional field | meaning |",
        "|---|---|---|",
    ]
    lines += [
        f"| `{op.name}` | {field} | {meaning} |"
        for op in OPS.values()
        for field, meaning in op.optional
    ]
    lines += ["", "| op | needs | its own checks | bad-input cases (error) |", "|---|---|---|---|"]
    for op in OPS.values():
        needs = ", ".join(f"`{n}`" for n in op.needs) or "—"
        checks = ", ".join(f"`{c.name}`" for c in op.checks) or "—"
        bad = ", ".join(f"`{b.case}` ({b.error})" for b in op.bad_inputs) or "—"
        lines.append(f"| `{op.name}` | {needs} | {checks} | {bad} |")
    lines.append("")
    for op in OPS.values():
        for note in op.notes:
            lines += textwrap.wrap(note, 78, initial_indent="- ", subsequent_indent="  ")
    return "\n".join(lines)


def render(document: str) -> str:
    """``document`` with its generated section replaced by ``vocabulary()``."""
    head, begin, rest = document.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"docs/ops.md has no {BEGIN} ... {END} section")
    return f"{head}{BEGIN}\n{vocabulary()}\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tqbatch.testing.contract.ops", description=__doc__
    )
    parser.add_argument("--write", type=Path, metavar="OPS_MD", help="rewrite this docs/ops.md")
    args = parser.parse_args(argv)
    if args.write:
        args.write.write_text(render(args.write.read_text()))
    else:
        sys.stdout.write(vocabulary() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
