"""What every bench report writes: CSV rows and the machine that measured them."""

from __future__ import annotations

import csv
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Rows (dicts with the same keys, in column order) as a CSV file with a header."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def machine_meta() -> dict[str, str]:
    """The machine and Python a figure was measured with (a report's meta carries them)."""
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.node()}".strip(),
        "python": platform.python_version(),
    }
