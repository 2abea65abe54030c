"""`bench-ar`: our AR against transformers' own greedy generate, side by side."""

from __future__ import annotations

import csv

from click.testing import CliRunner

from tokenswift_trt.bench.reference import compare_with_reference, load_reference
from tokenswift_trt.builder.presets import PRESETS, local_model_dir
from tokenswift_trt.cli import main


def test_both_generate_the_same_greedy_tokens_and_are_timed(llama_dir):
    from conftest import quiet_load

    directory, _ = llama_dir
    engine = quiet_load(directory)
    result = compare_with_reference(engine, load_reference(directory), [5, 6, 7, 8], 24, repeats=2)
    assert result.same_tokens and len(result.ours_tokens_per_s) == len(result.reference_tokens_per_s) == 2
    assert result.ratio > 0 and result.ours_median > 0 and result.reference_median > 0


def test_cli_writes_a_row(tmp_path):
    directory, _ = local_model_dir(PRESETS["swift-tiny"])
    out = tmp_path / "ar"
    args = [
        "bench-ar",
        "--model",
        "swift-tiny",
        "--prompt-file",
        str(directory / "prompt.txt"),
        "--prefix-len",
        "32",
        "--gen-len",
        "16",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (row,) = list(csv.DictReader(open(out / "bench_ar.csv")))
    assert row["same_tokens"] == "True" and float(row["ours_over_transformers"]) > 0
    engine = CliRunner().invoke(main, ["bench-ar", "--engine", str(tmp_path), "--prompt-file", "x"])
    assert engine.exit_code == 2 and "transformers" in engine.stderr


def test_the_report_holds_the_medians_their_ratio_and_every_repeat(tmp_path):
    import json

    from tokenswift_trt.bench.reference import ReferenceComparison, write_reference_report

    result = ReferenceComparison(16, [10.0, 30.0, 20.0], [10.0, 10.0, 40.0], same_tokens=True)
    row = write_reference_report(result, "model", 32, 3, tmp_path / "ar", "tokenswift-trt bench-ar x")
    assert row["ours_tokens_per_s"] == 20.0 and row["transformers_tokens_per_s"] == 10.0
    assert row["ours_over_transformers"] == 1.0  # the median of 1, 3 and 0.5
    assert (row["model"], row["prefix_len"], row["gen_len"], row["repeats"]) == ("model", 32, 16, 3)
    (written,) = list(csv.DictReader(open(tmp_path / "ar" / "bench_ar.csv")))
    assert written == {key: str(value) for key, value in row.items()}
    report = json.loads((tmp_path / "ar" / "bench_ar.json").read_text())
    assert report["row"] == row and report["meta"]["command"] == "tokenswift-trt bench-ar x"
    assert report["ours"] == [10.0, 30.0, 20.0] and report["transformers"] == [10.0, 10.0, 40.0]
    assert "machine" in report["meta"]
