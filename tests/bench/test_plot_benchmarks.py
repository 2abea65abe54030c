"""scripts/plot_benchmarks.py: the plots of docs/benchmarks.md come from the committed runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_three_plots_are_drawn_from_docs_bench(tmp_path):
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "plot_benchmarks.py"),
            "--bench",
            str(ROOT / "docs" / "bench"),
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    for name in ("speedup.png", "acceptance.png", "iteration.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (ROOT / "docs" / "bench" / "plots" / name).is_file(), (
            f"docs/bench/plots/{name} is not committed"
        )
