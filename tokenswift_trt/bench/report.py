"""What every bench report writes: CSV rows, and JSON rows with the machine that measured them."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenswift_trt.environment import machine_meta


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Rows (dicts with the same keys, in column order) as a CSV file with a header."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_run_json(out_dir: Path, command: str, rows: Sequence[dict[str, Any]]) -> Path:
    """`out_dir`/run.json: the rows a command printed, with the machine, date and the command that
    repeats them (`meta`), as the artefacts under docs/bench record them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "run.json"
    document = {"meta": {**machine_meta(), "command": command}, "rows": list(rows)}
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path
