"""tools/pick_cascade.py: the switches and threshold gpu_checks.sh's e2e-picked stage runs with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rows(variant: str, costs: dict[tuple[int, str], float]) -> list[dict]:
    return [
        {"variant": variant, "context": c, "step": s, "ms": ms, "floor_ms": 1.0}
        for (c, s), ms in costs.items()
    ]


def run_pick(tmp_path: Path, table: list[dict]) -> str:
    path = tmp_path / "variants.json"
    path.write_text(json.dumps({"rows": table}))
    result = subprocess.run(
        [sys.executable, "-m", "tools.pick_cascade", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout


def test_the_fastest_cascade_variant_and_the_threshold_from_its_crossings(tmp_path):
    kernel = {
        (4096, "verify_T1"): 5,
        (102400, "verify_T1"): 8,
        (4096, "verify_T64"): 10,
        (102400, "verify_T64"): 30,
        (4096, "verify_T128"): 12,
        (102400, "verify_T128"): 52,
    }
    base = {**kernel, (102400, "verify_T64"): 21.0}
    tail = {
        (4096, "verify_T1"): 6,
        (102400, "verify_T1"): 9,
        (4096, "verify_T64"): 12,
        (102400, "verify_T64"): 20,
        (4096, "verify_T128"): 15,
        (102400, "verify_T128"): 35,
    }
    triton = {**tail, (102400, "verify_T64"): 20.7}  # slower than +tail: not picked
    table = (
        rows("kernel+fused", kernel)
        + rows("flash_cascade+fused", base)
        + rows("flash_cascade+fused+tail", tail)
        + rows("flash_cascade+fused+tail+triton", triton)
    )
    out = run_pick(tmp_path, table).splitlines()
    exports = [line for line in out if line.startswith("--kernel")]
    # T = 64 crosses at 4096 + 2 / (12 / 98304) = 20,480 keys, T = 128 at 4096 + 3 / (20 / 98304)
    # = 18,841.6: the threshold is the mean of 64 x 20,480 and 128 x 18,841.6
    assert exports == [
        "--kernel cascade_tail=kernel",
        "--kernel cascade_prefix=flash",  # off, said: the engine's default is triton
        f"--kernel cascade_min_work={round((64 * 20480 + 128 * 18841.6) / 2)}",
    ]


def test_a_variant_within_the_margin_switches_nothing_and_no_crossing_keeps_the_threshold(tmp_path):
    kernel = {(4096, "verify_T64"): 10, (102400, "verify_T64"): 30}
    base = {(4096, "verify_T64"): 12, (102400, "verify_T64"): 40}  # steeper than the kernel: never crosses
    near = {(4096, "verify_T64"): 12, (102400, "verify_T64"): 39.5}  # 1.25% faster, under the 2% margin
    out = run_pick(
        tmp_path,
        rows("kernel+fused", kernel)
        + rows("flash_cascade+fused", base)
        + rows("flash_cascade+fused+tail", near),
    )
    assert "picked flash_cascade+fused 40.00 ms" in out and "never crosses" in out
    exports = [line for line in out.splitlines() if line.startswith("--kernel")]
    assert exports == ["--kernel cascade_tail=torch", "--kernel cascade_prefix=flash"]
