"""tools/bench_ar.py: our AR against transformers' own greedy generate, side by side."""

from __future__ import annotations

import csv

import pytest

from tokenswift_trt.builder.presets import PRESETS, local_model_dir
from tools.bench_ar import (
    ReferenceComparison,
    compare_with_reference,
    load_reference,
    main,
    write_reference_report,
)


def test_both_generate_the_same_greedy_tokens_and_are_timed(llama_dir):
    from conftest import quiet_load

    directory, _ = llama_dir
    engine = quiet_load(directory)
    result = compare_with_reference(engine, load_reference(directory), [5, 6, 7, 8], 24, repeats=2)
    assert result.same_tokens and len(result.ours_tokens_per_s) == len(result.reference_tokens_per_s) == 2
    assert result.ratio > 0 and result.ours_median > 0 and result.reference_median > 0


def test_the_tool_writes_a_row(tmp_path, capsys):
    directory, _ = local_model_dir(PRESETS["swift-tiny"])
    out = tmp_path / "ar"
    args = [
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
    assert main(args) == 0
    (row,) = list(csv.DictReader(open(out / "bench_ar.csv")))
    assert row["same_tokens"] == "True" and float(row["ours_over_transformers"]) > 0
    with pytest.raises(SystemExit) as refused:  # no model given
        main(["--prompt-file", str(directory / "prompt.txt")])
    assert refused.value.code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--model-dir", str(empty), "--prompt-file", str(directory / "prompt.txt")]) == 2
    assert "error:" in capsys.readouterr().err


def test_the_report_holds_the_medians_their_ratio_and_every_repeat(tmp_path):
    import json

    result = ReferenceComparison(16, [10.0, 30.0, 20.0], [10.0, 10.0, 40.0], same_tokens=True)
    row = write_reference_report(result, "model", 32, 3, tmp_path / "ar", "python -m tools.bench_ar x")
    assert row["ours_tokens_per_s"] == 20.0 and row["transformers_tokens_per_s"] == 10.0
    assert row["ours_over_transformers"] == 1.0  # the median of 1, 3 and 0.5
    assert (row["model"], row["prefix_len"], row["gen_len"], row["repeats"]) == ("model", 32, 16, 3)
    (written,) = list(csv.DictReader(open(tmp_path / "ar" / "bench_ar.csv")))
    assert written == {key: str(value) for key, value in row.items()}
    report = json.loads((tmp_path / "ar" / "bench_ar.json").read_text())
    assert report["row"] == row and report["meta"]["command"] == "python -m tools.bench_ar x"
    assert report["ours"] == [10.0, 30.0, 20.0] and report["transformers"] == [10.0, 10.0, 40.0]
    assert report["meta"]["date"] and report["meta"]["cpu"]
