"""`bench.compare`, the library calls under `bench`: random-weights requests checked before any weights
are built, the rows of a run, and the report with the measured times and the modeled long run."""

from __future__ import annotations

import json

import pytest

from tokenswift_trt.bench.compare import (
    RANDOM_WEIGHTS_COLUMNS,
    BenchError,
    BenchJob,
    check_counts,
    check_random_weights,
    random_weights_engine,
    run_comparison,
    write_comparison,
)
from tokenswift_trt.bench.run import BenchSpec
from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.decode.config import GenerationConfig


@pytest.mark.parametrize(
    "model, others, tree, accept, message",
    [
        (None, False, "1,3", None, "--random-weights takes --model"),
        ("swift-tiny", True, "1,3", None, "no --model-dir"),
        ("swift-tiny", False, "auto", None, "static --tree"),
        ("swift-tiny", False, "1,3", float("nan"), "at least 1"),
        ("swift-tiny", False, "1,3", 3.5, "give at most 3"),  # depth 2: at most 3 tokens an iteration
    ],
)
def test_random_weights_requests_are_checked_before_weights_are_built(model, others, tree, accept, message):
    with pytest.raises(BenchError, match=message):
        check_random_weights(model, others, tree, accept)


def test_counts_are_checked():
    check_counts(1, 1, 0, 1)
    for bad in ((0, 1, 0, 1), (1, 1, -1, 1), (1, 1, 0, 0)):
        with pytest.raises(BenchError):
            check_counts(*bad)


def test_a_random_weights_run_reports_measured_times_and_a_modeled_long_run(tmp_path):
    model = str(write_random_model(tmp_path / "model", seed=3))
    assert check_random_weights(model, False, "1,3", None) == {}  # a directory: no preset defaults
    engine, ids = random_weights_engine(model, None, "cpu", {}, (8, 16), prompts=1)
    assert len(ids) == 32 and min(ids) >= 3
    config = GenerationConfig(max_new_tokens=12, seed=0, tree="1,3", ngram_topk=2)
    spec = BenchSpec((6, 12), (8, 16), 1, 1, config, interleave=4, extras=False, window_tokens=4)
    labels: list[str] = []

    def progress(label: str, total: int):
        labels.append(label)
        return lambda ids: None

    rows = run_comparison(engine, ids, spec, progress)
    assert [(row["prefix_len"], row["gen_len"]) for row in rows] == [(8, 6), (8, 12), (16, 6), (16, 12)]
    assert all(row["tokens_equal_ar"] for row in rows)  # lossless on random weights too
    assert len(labels) == 2  # one turn-taking run per prompt length

    job = BenchJob(spec, tmp_path / "out", command="test", source="tiny", random_weights_model=model)
    outcome = write_comparison(engine, rows, job)
    assert outcome.columns == [c for c in RANDOM_WEIGHTS_COLUMNS if c in rows[0]]
    assert "ar_ms_per_token" in outcome.columns and "modeled_speedup" in outcome.columns
    assert outcome.meta["accept_length"] == 3  # not given: all the tree commits, depth 2 + 1
    for row in outcome.rows:
        expected = 3 * row["ar_ms_per_token"] / row["tokenswift_ms_per_iteration"]
        assert row["modeled_speedup"] == pytest.approx(expected, rel=0.01, abs=0.002)
    assert outcome.long_run is not None and outcome.long_run["tokens"] == 8  # from 8 to 16 tokens of prompt
    assert outcome.tokens_equal_ar
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["meta"]["command"] == "test" and report["meta"]["modeled_long_run"] == outcome.long_run
    assert {p.name for p in outcome.written} >= {"bench.csv", "bench.json"}


def test_a_prompt_and_generation_beyond_the_maximum_length_is_refused(tmp_path):
    model = str(write_random_model(tmp_path / "model", seed=3))
    engine, ids = random_weights_engine(model, None, "cpu", {}, (8,), prompts=1)
    config = GenerationConfig(max_new_tokens=12, seed=0, tree="1,3", max_length=16)
    spec = BenchSpec((12,), (8,), 1, 1, config)
    with pytest.raises(BenchError, match="prefix 8 \\+ generation 12 exceeds the maximum length 16"):
        run_comparison(engine, ids, spec, lambda label, total: lambda ids: None)
