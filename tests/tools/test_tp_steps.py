"""tools/tp_steps.py on the CPU (real gloo ranks the tool starts): rank 0 alone prints and writes
tp_steps.csv and tp_steps.json, a row per (context, tokens) with the step, its all-reduces and the LM
head replicated or split over the vocabulary."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--model", "swift-tiny", "--tp", "2", "--contexts", "64", "--tree-sizes", "1,4"]


def _tool(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tools.tp_steps", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_lm_head_split_over_the_vocabulary_is_timed_on_rank_0(tmp_path):
    # the replicated head is the same tool path with the other --tp-head (tests/model/test_tensor_parallel.py
    # decodes with both)
    head = "vocab"
    out = tmp_path / head
    result = _tool(*ARGS, "--step-repeats", "1", "--tp-head", head, "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "tp_steps.json").read_text())
    meta = report["meta"]
    assert meta["tp"] == 2 and meta["backend"] == "gloo" and meta["tp_head"] == head
    command = f"python -m tools.tp_steps --model swift-tiny --tp 2 --tp-head {head}"
    assert meta["command"].startswith(command)
    assert meta["screened_head"] is False  # never a split one
    assert [(row["context"], row["tokens"]) for row in report["rows"]] == [(64, 1), (64, 4)]
    for row in report["rows"]:
        assert row["all_reduces"] == 12  # 2 per layer of swift-tiny's 6
        assert row["step_ms"] > 0 and row["all_reduce_ms"] > 0 and row["head_ms"] > 0
    rows = list(csv.DictReader(open(out / "tp_steps.csv")))
    assert [int(row["tokens"]) for row in rows] == [1, 4]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and all(f"LM head ({head})" in line for line in lines)  # rank 0's rows only


def test_a_size_the_model_does_not_split_into_is_refused_before_any_rank_starts(tmp_path):
    result = _tool("--model", "smollm2-135m", "--tp", "2", "--out", str(tmp_path))
    assert result.returncode == 2
    assert "--tp 1, 3" in result.stderr.strip().splitlines()[-1]
