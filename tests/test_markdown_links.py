"""Every relative link in the README and docs/ reaches a file that exists, and every #section in it
a heading of that page (GitHub's anchor for it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
FENCE = re.compile(r"^\s*```")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces to
    hyphens, a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    for line in _prose(text):
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def test_anchor_rules_follow_github():
    text = "# Draft layers (model/draft_layers.py)\n```\n# not a heading\n```\n"
    text += "## Why `--tree auto`?\n## A\n## A\n"
    assert anchors(text) == {"draft-layers-modeldraft_layerspy", "why---tree-auto", "a", "a-1"}


def test_every_relative_link_reaches_a_file_and_section():
    broken = []
    for page in _pages():
        for line in _prose(page.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, section = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}: ({target})"
                if not file.exists():
                    broken.append(f"{where}: no such file")
                elif section and file.suffix == ".md" and section not in anchors(file.read_text()):
                    broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)
