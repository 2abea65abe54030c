"""tools/plot_benchmarks.py: the plots of docs/benchmarks.md come from the committed runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def test_the_three_plots_are_drawn_from_docs_bench(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.plot_benchmarks",
            "--bench",
            str(ROOT / "docs" / "bench"),
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    for name in ("speedup.png", "acceptance.png", "iteration.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (ROOT / "docs" / "bench" / "plots" / name).is_file(), (
            f"docs/bench/plots/{name} is not committed"
        )


def _run_script(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tools.plot_benchmarks", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)


def test_plot_script_draws_windows_from_bench_jsons_and_refuses_one_without(tmp_path):
    window = dict(
        iterations=4, tokens=10, drafted_tokens=8, accepted_tokens=6, ngram_accepted_tokens=1, alpha=0.75,
        beta=0.125, tokens_per_iteration=2.5, ar_tokens_per_s=20.0, tokenswift_tokens_per_s=45.0,
    )  # fmt: skip
    rows = [
        {
            "prefix_len": prefix_len,
            "gen_len": 32,
            "windows": [
                {
                    **window,
                    "start": 0,
                    "end": 16,
                    "reached_by_depth": [4, 3],
                    "alpha_by_depth": [0.75, 2 / 3],
                },
                {
                    **window,
                    "start": 16,
                    "end": 32,
                    "reached_by_depth": [4, 2],
                    "alpha_by_depth": [0.5, 1.0],
                },
            ],
        }
        for prefix_len in (32, 64)
    ]
    for name in ("static", "adapted"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    out = tmp_path / "plots"
    jsons = [str(tmp_path / name / "bench.json") for name in ("static", "adapted")]
    result = _run_script("--windows", jsons[0], "--windows", jsons[1], "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert (out / "windows.png").read_bytes()[:8] == PNG
    assert sorted(path.name for path in out.iterdir()) == ["windows.png"]

    (tmp_path / "old.json").write_text(json.dumps({"meta": {}, "rows": [{"prefix_len": 32, "gen_len": 32}]}))
    refused = _run_script("--windows", str(tmp_path / "old.json"), "--out", str(out))
    assert refused.returncode == 2
    assert "has no figures by position (windows): rerun bench" in refused.stderr.strip().splitlines()[-1]


def test_windows_runs_add_the_adapted_layers_beside_the_static_ones(tmp_path):
    from tools.plot_benchmarks import windows_runs

    plain, compared = tmp_path / "plain" / "bench.json", tmp_path / "compared" / "bench.json"
    for path, row in ((plain, {"windows": [{}]}), (compared, {"windows": [{}], "adapted_windows": [{}]})):
        path.parent.mkdir()
        path.write_text(json.dumps({"meta": {}, "rows": [row]}))
    assert windows_runs([plain, compared]) == [
        ("plain", plain, "windows"),
        ("compared", compared, "windows"),
        ("compared, adapted", compared, "adapted_windows"),
    ]


def test_run_plots_are_drawn_from_the_files_bench_and_bench_steps_write(tmp_path):
    """`--run DIR`: speedup.png and alpha.png from bench's bench.json, steps.png from bench-steps'
    steps.json (the package writes only CSV and JSON); a folder with neither is a one-line error."""
    from tokenswift_trt.bench.run import write_results
    from tokenswift_trt.bench.steps import ModeledSpeedup, StepCost, write_step_report

    run = tmp_path / "run"
    rows = [
        {"prefix_len": prefix_len, "gen_len": gen_len, "speedup": 1.1, "alpha": 0.5}
        for prefix_len in (32, 64)
        for gen_len in (64, 128)
    ]
    write_results(rows, run, {"command": "test"})
    costs = [
        StepCost(context, step, tokens, seconds=1e-3 * tokens, bytes_read=1000, bandwidth_seconds=5e-4)
        for context in (64, 128)
        for step, tokens in (("ar", 1), ("verify_T4", 4))
    ]
    speedups = [ModeledSpeedup(256, mode, 2.0, 4, 1.0, 0.8) for mode in ("partial", "verify")]
    write_step_report(costs, speedups, run, {"command": "test", "model": "tiny"})
    assert not list(run.glob("*.png"))

    result = _run_script("--run", str(run))
    assert result.returncode == 0, result.stderr
    for name in ("speedup.png", "alpha.png", "steps.png"):
        assert (run / name).read_bytes()[:8] == PNG, name

    out = tmp_path / "plots"
    assert _run_script("--run", str(run), "--out", str(out)).returncode == 0
    assert sorted(path.name for path in out.iterdir()) == ["alpha.png", "speedup.png", "steps.png"]

    empty = tmp_path / "empty"
    empty.mkdir()
    refused = _run_script("--run", str(empty))
    assert refused.returncode == 2
    assert "holds neither bench.json nor steps.json" in refused.stderr.strip().splitlines()[-1]
