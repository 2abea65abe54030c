"""The bench's figures by output position: per-window rows in bench.json and bench_windows.csv, summed
over runs, with each method's tokens/s per window."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenswift_trt.bench.run import BenchSpec, Snapshot, merged_windows, run_bench, write_results
from tokenswift_trt.cli import main
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.stats import Window
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "swift-tiny"


def _snapshot(windows: list[Window], ends: list[float], prefill_s: float = 0.5) -> Snapshot:
    tokens = sum(w.tokens for w in windows) + 1
    return Snapshot(
        tokens, ends[-1], 0, 0, 0, 0, 0, prefill_s, windows=tuple(windows), window_ends_s=tuple(ends)
    )


def test_window_rates_leave_the_prefill_out_and_runs_sum_window_by_window():
    first = Window(0, 16, iterations=5, tokens=15, drafted_tokens=10, accepted_tokens=10)
    first.reached_by_depth, first.accepted_by_depth = [5, 4], [4, 3]
    second = Window(16, 16, iterations=8, tokens=16, drafted_tokens=16, accepted_tokens=8)
    second.reached_by_depth, second.accepted_by_depth = [8, 1, 1], [1, 1, 0]
    snapshot = _snapshot([first, second], [2.0, 6.0])
    assert snapshot.window_tokens_per_s() == [15 / 1.5, 16 / 4.0]
    (merged_first, merged_second) = merged_windows([snapshot, snapshot])
    assert (merged_first.iterations, merged_first.tokens, merged_first.accepted_tokens) == (10, 30, 20)
    assert merged_second.reached_by_depth == [16, 2, 2] and merged_second.accepted_by_depth == [2, 2, 0]
    assert merged_second.figures()["alpha_by_depth"] == [2 / 16, 1.0, 0.0]
    assert merged_second.figures()["tokens_per_iteration"] == 2.0


@pytest.fixture(scope="module")
def swift_tiny():
    if not (MODEL / "model.safetensors").is_file():
        pytest.skip("models/swift-tiny is not in this checkout")
    return load_engine(MODEL), TextCodec.from_dir(MODEL).encode((MODEL / "prompt.txt").read_text())


def test_bench_rows_carry_windows_that_add_up_and_are_written_and_plotted(swift_tiny, tmp_path):
    engine, text_ids = swift_tiny
    config = GenerationConfig(
        max_new_tokens=48, tree="3,3", ngram_topk=4, draft_source="verify", sampling=SamplingConfig(), seed=0
    )
    spec = BenchSpec((24, 48), (32,), 1, 1, config, interleave=16, extras=False, window_tokens=16)
    rows = run_bench(engine, text_ids, spec, lambda label, total: lambda ids: None)
    short, long = rows
    assert short["tokens_equal_ar"] and long["tokens_equal_ar"]
    assert [(w["start"], w["end"]) for w in long["windows"]] == [(0, 16), (16, 32), (32, 48)]
    assert [w["start"] for w in short["windows"]] == [0, 16]
    assert short["windows"][0] == long["windows"][0]  # a window the shorter length saw whole
    windows = long["windows"]
    # every position of the 48 but the prefill's token, in some window
    assert sum(w["tokens"] for w in windows) == 47
    drafted, accepted = sum(w["drafted_tokens"] for w in windows), sum(w["accepted_tokens"] for w in windows)
    assert round(accepted / drafted, 4) == long["alpha"]
    iterations = sum(w["iterations"] for w in windows)
    assert round(1 + accepted / iterations, 3) == long["tokens_per_iteration"]
    assert all(w["ar_tokens_per_s"] > 0 and w["tokenswift_tokens_per_s"] > 0 for w in windows)
    assert all(len(w["alpha_by_depth"]) >= 2 for w in windows)

    written = write_results(rows, tmp_path, {"command": "test"})
    assert {path.name for path in written} >= {"bench.csv", "bench.json", "bench_windows.csv"}
    assert "windows" not in next(csv.DictReader(open(tmp_path / "bench.csv")))
    flat = list(csv.DictReader(open(tmp_path / "bench_windows.csv")))
    assert len(flat) == len(short["windows"]) + len(windows)
    last = flat[-1]
    assert (last["gen_len"], last["start"], last["end"]) == ("48", "32", "48")
    assert float(last["alpha_d1"]) == windows[-1]["alpha_by_depth"][0]
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][1]["windows"] == windows


@pytest.mark.parametrize("device_loop", [None, True], ids=["host-loop", "device-loop"])
def test_compare_adaptation_rows_carry_the_adapted_run_beside_the_static_one(
    swift_tiny, tmp_path, device_loop
):
    """`bench --compare-adaptation`: the adapted layers' run, its steps, its windows (variant "adapted"
    in bench_windows.csv) and its tokens against AR's, on either loop."""
    engine, text_ids = swift_tiny
    paper = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=64)
    config = GenerationConfig(
        max_new_tokens=48,
        tree="1,1,1",
        ngram_topk=0,
        draft_source="verify",
        sampling=paper,
        seed=0,
        device_loop=device_loop,
    )
    spec = BenchSpec(
        (48,), (32,), 1, 1, config, interleave=16, extras=False, window_tokens=16, compare_adaptation=True
    )
    (row,) = run_bench(engine, text_ids, spec, lambda label, total: lambda ids: None)
    assert row["tokens_equal_ar"] and row["adapted_tokens_equal_ar"]
    assert row["adapted_draft_updates"] == 47 // 16  # a step per 16 committed positions
    assert row["draft_updates"] == 0  # the static layers' run took none
    assert row["adapted_decode_ms_per_iteration"] > 0 and row["adapted_tokens_per_iteration"] >= 1
    assert [w["start"] for w in row["adapted_windows"]] == [0, 16, 32]
    write_results([row], tmp_path, {"command": "test"})
    variants = [line["variant"] for line in csv.DictReader(open(tmp_path / "bench_windows.csv"))]
    assert variants == ["tokenswift"] * 3 + ["adapted"] * 3


def test_bench_command_writes_windows_of_the_size_asked_and_refuses_an_empty_one(swift_tiny, tmp_path):
    args = [
        "bench",
        "--model-dir",
        str(MODEL),
        "--prompt-file",
        str(MODEL / "prompt.txt"),
        "--prefix-len",
        "32",
    ]
    args += [
        "--gen-len",
        "24",
        "--no-extras",
        "--tree",
        "3,3",
        "--draft-source",
        "verify",
        "--out",
        str(tmp_path),
    ]
    result = CliRunner().invoke(main, [*args, "--window", "8"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["window_tokens"] == 8
    assert [w["start"] for w in report["rows"][0]["windows"]] == [0, 8, 16]
    flat = list(csv.DictReader(open(tmp_path / "bench_windows.csv")))
    assert [row["start"] for row in flat] == ["0", "8", "16"]
    refused = CliRunner().invoke(main, [*args, "--window", "0"])
    assert refused.exit_code == 2 and "--window must be at least 1 token" in refused.stderr


def test_bench_with_adapt_drafts_records_the_settings_and_the_steps(tmp_path):
    """`bench --adapt-drafts`: the TokenSwift runs adapt; bench.json says so, with the settings, and
    each row counts the steps."""
    args = ["bench", "--model-dir", str(MODEL), "--prompt-file", str(MODEL / "prompt.txt")]
    args += ["--prefix-len", "32", "--gen-len", "32", "--no-extras", "--tree", "1,1,1", "--ngram-topk", "0"]
    args += ["--draft-source", "verify", "--adapt-drafts", "--adapt-block", "4", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["adapt_drafts"] and report["meta"]["adaptation"]["block"] == 4
    (row,) = report["rows"]
    assert row["draft_updates"] >= 31 // 4 - 1 and row["tokens_equal_ar"]
