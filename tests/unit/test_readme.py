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


ROOT = README.parent
# [text](target) where target is not a URL; `<!-- -->` comments and code spans cannot hold links.
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _CODE.sub("", page.read_text()) if page.suffix == ".md" else ""
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def broken_links(root: Path) -> list[str]:
    """Every relative link in README.md and docs/**/*.md that does not resolve to a file or folder
    inside ``root`` (or names a heading its page does not have)."""
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in _LINK.findall(_CODE.sub("", page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}: {target}"
            if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
                broken.append(where)
            elif anchor and resolved.is_file() and anchor not in _anchors(resolved):
                broken.append(f"{where} (no such heading)")
    return broken


def test_every_relative_link_in_readme_and_docs_resolves_inside_the_repository():
    assert broken_links(ROOT) == []


def test_the_link_check_fails_on_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n[back](../README.md#top)\n")
    (tmp_path / "README.md").write_text(
        "# Top\n\n[a](docs/a.md) [gone](docs/gone.md) [out](../shared/gpu/stage.sh)\n"
        "[bad anchor](docs/a.md#b) [web](https://example.com) `[code](nowhere.md)`\n"
    )
    assert broken_links(tmp_path) == [
        "README.md: docs/gone.md",
        "README.md: ../shared/gpu/stage.sh",
        "README.md: docs/a.md#b (no such heading)",
    ]
