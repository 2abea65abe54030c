"""`bench --tp 2` and `demo --tp 2` on the CPU (real gloo ranks the command starts): rank 0 alone
prints and writes the report, and the runs decode what the single-process runs decode (the same
acceptance figures, TokenSwift's tokens equal to AR's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from tokenswift_trt.cli import main

ROOT = Path(__file__).resolve().parents[2]
BENCH = ["bench", "--model", "swift-tiny", "--prompt-file", str(ROOT / "models/swift-tiny/prompt.txt")]
BENCH += ["--gen-len", "24,48", "--prefix-len", "64", "--no-extras", "--tree", "1,3,3", "--seed", "3"]
SAME = ("alpha", "alpha_by_depth", "beta", "tokens_per_iteration", "tokens_per_forward", "distinct4_penalty")


def _ranks(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tokenswift_trt", *args, "--tp", "2"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bench_on_two_ranks_reports_the_single_process_generations_from_rank_0(tmp_path):
    result = _ranks(*BENCH, "--out", str(tmp_path / "tp"))
    assert result.returncode == 0, result.stderr
    header = [line for line in result.stdout.splitlines() if line.startswith("prefix_len |")]
    assert len(header) == 1  # rank 1 printed nothing
    report = json.loads((tmp_path / "tp" / "bench.json").read_text())
    assert report["meta"]["tp"] == 2 and report["meta"]["tree"] == "1,3,3"
    rows = report["rows"]
    assert [(row["prefix_len"], row["gen_len"]) for row in rows] == [(64, 24), (64, 48)]
    assert all(row["tokens_equal_ar"] for row in rows)
    single = CliRunner().invoke(main, [*BENCH, "--out", str(tmp_path / "one")])
    assert single.exit_code == 0, single.output
    expected = json.loads((tmp_path / "one" / "bench.json").read_text())["rows"]
    assert expected[0]["alpha"] > 0  # TokenSwift drafted and accepted: the figures below say something
    for row, one in zip(rows, expected, strict=True):
        assert {key: row[key] for key in SAME} == {key: one[key] for key in SAME}


def test_demo_on_two_ranks_prints_the_single_process_figures_once():
    args = ["demo", "--model", "swift-tiny", "--max-new-tokens", "48", "--tree", "1,3,3"]
    result = _ranks(*args)
    assert result.returncode == 0, result.stderr
    figures = [line for line in result.stdout.splitlines() if line.startswith(("speedup", "α by depth"))]
    assert len(figures) == 2 and "same tokens as AR: True" in figures[0]
    single = CliRunner().invoke(main, args)
    assert single.exit_code == 0, single.output
    expected = [line for line in single.stdout.splitlines() if line.startswith(("speedup", "α by depth"))]
    assert figures[0].split("α")[1] == expected[0].split("α")[1]  # α, β, tokens/iteration, agreement
    assert figures[1] == expected[1]


def test_bench_random_weights_under_tp_is_refused_in_one_line():
    args = ["bench", "--model", "swift-tiny", "--random-weights", "--tree", "1,3", "--tp", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "drop --tp 2 (the repository's `python -m tools.tp_steps --tp 2`" in lines[0]
