"""The README's usage example runs, and its comments tell the truth."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _usage_example() -> str:
    text = README.read_text()
    section = text[text.index("## Using the cache") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_usage_example_runs_as_commented():
    namespace: dict = {}
    exec(compile(_usage_example(), "README usage example", "exec"), namespace)
    batch, done, mask = namespace["batch"], namespace["done"], namespace["mask"]
    assert mask.shape == (2, 1, 1, 6)  # "(2, 1, 1, 6), as BatchKVCache's"
    # After filter([1]) only request b is left; its 3 prompt tokens + 1 decode step.
    assert batch.offset.tolist() == [4] and batch.left_padding.tolist() == [0]
    assert done.offset == 4 and done.size() == 4
