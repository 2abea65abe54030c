"""What every bench report writes: CSV rows, JSON rows and the machine that measured them."""

from __future__ import annotations

import csv
import json
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


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` knows elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_meta() -> dict[str, Any]:
    """The machine, Python and PyTorch a figure was measured with, and the date (a report's meta)."""
    import datetime

    import torch

    from tokenswift_trt.decode.threads import usable_cpus

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu": cpu_model(),
        "cpus": usable_cpus(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def write_run_json(out_dir: Path, command: str, rows: Sequence[dict[str, Any]]) -> Path:
    """`out_dir`/run.json: the rows a command printed, with the machine, date and the command that
    repeats them (`meta`), as the artefacts under docs/bench record them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "run.json"
    document = {"meta": {**machine_meta(), "command": command}, "rows": list(rows)}
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path
