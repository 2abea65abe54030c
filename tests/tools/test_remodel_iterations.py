"""tools/remodel_iterations.py: modeled speedups never assume more tokens per iteration than the trie
commits, and they follow from the measured times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def random_weights_run(path: Path, tree: str = "3,3,3") -> Path:
    rows = [
        {
            "prefix_len": 4096,
            "ar_ms_per_token": 6.0,
            "tokenswift_ms_per_iteration": 9.0,
            "iteration_over_ar_step": 1.5,
        },
        {
            "prefix_len": 8192,
            "ar_ms_per_token": 8.0,
            "tokenswift_ms_per_iteration": 16.0,
            "iteration_over_ar_step": 2.0,
        },
    ]
    path.write_text(json.dumps({"meta": {"tree": tree, "ngram_topk": 4}, "rows": rows}))
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tools.remodel_iterations", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)


def test_the_cap_is_depth_plus_one_and_speedups_follow_the_measured_times(tmp_path):
    run_json = random_weights_run(tmp_path / "bench.json")
    real = tmp_path / "real.json"
    real.write_text(
        json.dumps(
            {
                "rows": [
                    {"prefix_len": 512, "gen_len": 1000, "tokens_per_iteration": 1.5},
                    {"prefix_len": 1024, "gen_len": 3000, "tokens_per_iteration": 2.0},
                ]
            }
        )
    )
    result = run(str(run_json), "--tau", "cap", "--tau", f"real={real}", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "modeled.json").read_text())
    assert report["trie_cap"] == 4
    assert [t["tau"] for t in report["taus"]] == [4.0, 1.875]  # weighted by generated length
    first, second = report["per_context"]
    assert first["speedup_cap"] == round(4.0 * 6.0 / 9.0, 3)
    assert second["speedup_real"] == round(1.875 * 8.0 / 16.0, 3)
    long_run = report["long_runs"]["cap"][-1]  # 4,096 tokens from 4K to 8K: mean costs 7 ms and 12.5 ms
    assert long_run["tokens"] == 4096
    assert long_run["modeled_speedup"] == round(7.0 / (12.5 / 4.0), 3)
    assert (tmp_path / "out" / "modeled.csv").read_text().startswith("prompt_length,")


def test_more_tokens_per_iteration_than_the_trie_commits_is_refused(tmp_path):
    run_json = random_weights_run(tmp_path / "bench.json", tree="3,3,3")
    result = run(str(run_json), "--tau", "4.36", "--out", str(tmp_path / "out"))
    assert result.returncode != 0
    assert "at most 4" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_runs_tau_is_its_longest_generation_per_prompt_length():
    from tools.remodel import run_tau

    # rows of one run at 1K, 4K and 8K hold the figures of the whole run up to each length
    rows = [
        {"prefix_len": 256, "gen_len": 1024, "tokens_per_iteration": 3.0},
        {"prefix_len": 256, "gen_len": 8192, "tokens_per_iteration": 2.0},
        {"prefix_len": 256, "gen_len": 4096, "tokens_per_iteration": 2.5},
    ]
    assert run_tau(rows) == 2.0


def test_steady_times_leave_the_first_tokens_out():
    from tools.remodel import steady_rows

    # AR: 63 steps at 5 ms (a slow first step inside), then 256 at 4 ms; TokenSwift at τ 1: 63 iterations
    # averaging 10 ms, then 256 at 8 ms
    rows = [
        {
            "prefix_len": 4096,
            "gen_len": 64,
            "tokens_per_iteration": 1.0,
            "ar_decode_ms_per_iteration": 5.0,
            "tokenswift_decode_ms_per_iteration": 10.0,
        },
        {
            "prefix_len": 4096,
            "gen_len": 320,
            "tokens_per_iteration": 1.0,
            "ar_decode_ms_per_iteration": (63 * 5.0 + 256 * 4.0) / 319,
            "tokenswift_decode_ms_per_iteration": (63 * 10.0 + 256 * 8.0) / 319,
        },
    ]
    (row,) = steady_rows(rows)
    assert row["ar_ms_per_token"] == 4.0 and row["tokenswift_ms_per_iteration"] == 8.0
    assert row["iteration_over_ar_step"] == 2.0 and row["tokens_timed"] == "64-320"
