"""Code that points a reader at the docs points at a page and section that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("tokenswift_trt", "tests", "scripts", "tools", "model_repo", "deploy", "Makefile", "README.md")
REFERENCE = re.compile(r'docs/([a-z0-9_-]+\.md)(?:,\s*"([^"]+)")?')
SUFFIXES = {".py", ".cpp", ".cu", ".h", ".cuh", ".sh", ".md", ".pbtxt"}
COMMENT = re.compile(r"\s*(?:#|//|\*)?\s+")  # a section name wrapped over comment lines


def _files():
    for name in SOURCES:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for child in path.rglob("*"):
                if child.is_file() and child.suffix in SUFFIXES:
                    yield child


def test_every_docs_reference_names_an_existing_page_and_section():
    missing = []
    for path in _files():
        text = path.read_text(errors="replace")
        for page, section in REFERENCE.findall(text):
            doc = ROOT / "docs" / page
            if not doc.is_file():
                missing.append(f"{path.relative_to(ROOT)}: docs/{page} does not exist")
                continue
            lines = doc.read_text().splitlines()
            headings = [line.lstrip("#").strip() for line in lines if line.startswith("#")]
            section = COMMENT.sub(" ", section).strip()
            if section and not any(section.lower() in heading.lower() for heading in headings):
                missing.append(f'{path.relative_to(ROOT)}: docs/{page} has no section "{section}"')
    assert not missing, "\n".join(missing)
