"""The artefacts under docs/bench record their machine and date, and no page or artefact names a path
of the machine a run was made on or a folder outside the repository."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
MACHINE_PATHS = ("../shared", "/work/", "/root/", "/tmp/")
TEXT_SUFFIXES = {".md", ".json", ".csv", ".log", ".txt", ".jsonl"}


def _has(value: object, key: str) -> bool:
    if isinstance(value, dict):
        return key in value or any(_has(item, key) for item in value.values())
    if isinstance(value, list):
        return any(_has(item, key) for item in value)
    return False


def test_every_bench_json_records_its_machine_and_date():
    missing = []
    for path in sorted(BENCH.rglob("*.json")):
        report = json.loads(path.read_text())
        if not _has(report, "date"):
            missing.append(f"{path.relative_to(ROOT)}: no date")
        if not (_has(report, "cpu") or _has(report, "gpu")):
            missing.append(f"{path.relative_to(ROOT)}: no cpu or gpu")
    assert not missing, "\n".join(missing)


def test_no_page_or_artefact_names_a_machine_path():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    artefacts = [path for path in BENCH.rglob("*") if path.is_file() and path.suffix in TEXT_SUFFIXES]
    found = []
    for path in pages + artefacts:
        text = path.read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for needle in MACHINE_PATHS if path in artefacts else MACHINE_PATHS[:2]:
                if needle in line:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {needle}")
    assert not found, "\n".join(found[:40])
