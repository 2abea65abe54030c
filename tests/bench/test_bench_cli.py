"""`tokenswift-trt bench` end to end on a tiny model: rows per length, equal tokens, CSV and plots."""

from __future__ import annotations

import csv
import json
import time

import pytest
from click.testing import CliRunner

from tokenswift_trt.bench.compare import measured_iteration_times, modeled_long_run
from tokenswift_trt.bench.run import (
    BenchSpec,
    Snapshot,
    plans_before,
    prompt_windows,
    run_bench,
    run_interleaved,
)
from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.cli import main
from tokenswift_trt.decode.autotune import Plan
from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.stats import Stats
from tokenswift_trt.decode.tree import TreeSpec
from tokenswift_trt.model.sampling import SamplingConfig

from conftest import quiet_load


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("random-tiny"), seed=3)


@pytest.mark.slow
def test_bench_writes_rows_per_length_with_auto_tree_comparison(model_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 40)
    out = tmp_path / "bench"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "--model-dir",
            str(model_dir),
            "--prompt-file",
            str(text),
            "--gen-len",
            "24,48",
            "--prefix-len",
            "32,64",
            "--prompts",
            "2",
            "--tree",
            "auto",
            "--draft-source",
            "partial",
            "--temperature",
            "0",
            "--penalty",
            "1.2",
            "--penalty-window",
            "16",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(open(out / "bench.csv")))
    assert [(r["prefix_len"], r["gen_len"]) for r in rows] == [
        ("32", "24"),
        ("32", "48"),
        ("64", "24"),
        ("64", "48"),
    ]
    for row in rows:
        assert row["tokens_equal_ar"] == "True" and row["runs"] == "2"
        assert float(row["speedup_min"]) <= float(row["speedup"]) <= float(row["speedup_max"])
        assert 0 <= float(row["beta"]) <= float(row["alpha"]) <= 1
        by_depth = [float(alpha) for alpha in row["alpha_by_depth"].split("/")]
        assert by_depth and all(0 <= alpha <= 1 for alpha in by_depth)
        assert 1 <= float(row["tokens_per_iteration"]) <= 5  # 1 + accepted per iteration, depth 4 at most
        assert (
            0.5 <= float(row["tokens_per_forward"]) <= float(row["tokens_per_iteration"])
        )  # ≤ 2 passes per iteration
        assert 0 < float(row["distinct4_penalty"]) <= 1 and float(row["auto_vs_default_tree"]) > 0
        assert row["auto_plans"].startswith("probe 1,3,2,1 k=4")  # the CPU's probe, partial drafting
    meta = json.loads((out / "bench.json").read_text())["meta"]
    assert meta["tree"] == "auto" and "bench" in meta["command"]
    assert meta["attention"] in ("sdpa", "cpu_tree_attention") and meta["fused_elementwise"] is False
    assert meta["batch_invariant"] is False  # the GPU switch (TOKENSWIFT_BATCH_INVARIANT), off by default
    assert not list(out.glob("*.png"))  # plots are tools.plot_benchmarks --run's


@pytest.mark.slow
def test_bench_drafting_from_the_verify_pass_compares_auto_with_the_papers_static_tree(model_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 40)
    out = tmp_path / "bench"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "--model-dir",
            str(model_dir),
            "--prompt-file",
            str(text),
            "--gen-len",
            "40",
            "--prefix-len",
            "32",
            "--tree",
            "auto",
            "--draft-source",
            "verify",
            "--min-p",
            "0.1",
            "--penalty",
            "1.2",
            "--penalty-window",
            "16",
            "--seed",
            "3",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    (row,) = list(csv.DictReader(open(out / "bench.csv")))
    assert row["tokens_equal_ar"] == "True"
    # drafting from the verify pass the probe scores the probe trie (3,2,1 k=4 on a CPU) on AR steps
    assert row["auto_plans"].startswith("probe on ar steps from token 1")
    assert float(row["default_tree_tokens_per_s"]) > 0  # 1,3,3,3 is 4 deep: it ran with the paper's drafting


def test_interleaved_runs_decode_what_separate_runs_do_each_on_its_own_clock(model_dir):
    engine = quiet_load(model_dir)
    prompt = list(range(3, 35))
    sampling = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=16)
    configs = {
        "ar": GenerationConfig(max_new_tokens=1, sampling=sampling, seed=2, method="ar"),
        "tokenswift": GenerationConfig(max_new_tokens=1, sampling=sampling, seed=2, tree="1,2", ngram_topk=4),
    }
    seen: list[int] = []
    started = time.perf_counter()
    runs = run_interleaved(engine, prompt, configs, [20, 50], chunk=8, on_tokens=seen.extend)
    wall = time.perf_counter() - started
    assert len(seen) == 100  # both runs, every token
    for name, config in configs.items():
        alone = run_interleaved(engine, prompt, {name: config}, [20, 50], chunk=50)[name]
        assert runs[name].tokens == alone.tokens and sorted(runs[name].snapshots) == [20, 50]
        assert 20 <= runs[name].snapshots[20].new_tokens < 50 <= runs[name].snapshots[50].new_tokens
    assert runs["ar"].tokens == runs["tokenswift"].tokens
    own = [runs[name].snapshots[50].elapsed_s for name in configs]
    assert 0 < min(own) and sum(own) <= wall  # each clock counts its own steps only
    assert runs["ar"].snapshots[20].elapsed_s < runs["ar"].snapshots[50].elapsed_s


def test_a_bench_that_does_not_fit_names_the_one_at_a_time_switch(model_dir):
    engine = quiet_load(model_dir)
    config = GenerationConfig(max_new_tokens=1, seed=1, tree="1,1", memory_budget=1)  # 1 byte: nothing fits
    spec = BenchSpec((16,), (32,), 1, 1, config)
    with pytest.raises(GenerationError, match="not enough memory.*--interleave 0 runs them one at a time"):
        run_bench(engine, list(range(3, 200)), spec, lambda label, total: None)


@pytest.mark.slow
def test_bench_runs_methods_one_after_another_on_request(model_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 40)
    args = [
        "bench",
        "--model-dir",
        str(model_dir),
        "--prompt-file",
        str(text),
        "--gen-len",
        "16",
        "--prefix-len",
        "32",
        "--tree",
        "1,1",
        "--out",
        str(tmp_path / "bench"),
    ]
    result = CliRunner().invoke(main, args + ["--interleave", "0"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())["meta"]["interleave"] == 0
    bad = CliRunner().invoke(main, args + ["--interleave", "-1"])
    assert bad.exit_code == 2 and "--interleave must be >= 0" in bad.stderr


def test_prompt_windows_and_bad_lengths(model_dir, tmp_path):
    assert prompt_windows(list(range(100)), 10, 3) == [
        list(range(0, 10)),
        list(range(30, 40)),
        list(range(60, 70)),
    ]
    with pytest.raises(ValueError, match="fewer than --prefix-len"):
        prompt_windows(list(range(5)), 10, 1)
    text = tmp_path / "short.txt"
    text.write_text("tiny")
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "--model-dir",
            str(model_dir),
            "--prompt-file",
            str(text),
            "--gen-len",
            "8",
            "--prefix-len",
            "64",
        ],
    )
    assert result.exit_code == 2 and "fewer than --prefix-len" in result.stderr
    bad = CliRunner().invoke(
        main, ["bench", "--model-dir", str(model_dir), "--prompt-file", str(text), "--gen-len", "8,x"]
    )
    assert bad.exit_code == 2 and "--gen-len" in bad.stderr


def test_a_rows_auto_plans_are_those_started_before_its_length():
    probe = TreeSpec.parse("1,3,3,3")
    plans = [Plan(probe, 20, 1, probe=True), Plan(None, 0, 30), Plan(probe, 20, 4168, probe=True)]
    assert str(plans[0]) == "probe 1,3,3,3 k=20 from token 1" and str(plans[1]) == "ar k=0 from token 30"
    assert plans_before(plans, 2048) == plans[:2]
    assert plans_before(plans, 30) == plans[:1] and plans_before(plans, 8192) == plans


def test_repeats_alternate_which_of_ar_and_tokenswift_runs_first():
    from tokenswift_trt.bench.run import run_order

    names = ["ar", "tokenswift", "no_penalty", "default_tree"]
    assert run_order(names, 0) == names
    assert run_order(names, 1) == ["tokenswift", "ar", "no_penalty", "default_tree"]
    assert run_order(names, 2) == names and names == ["ar", "tokenswift", "no_penalty", "default_tree"]


@pytest.mark.slow
def test_bench_without_extras_runs_ar_and_tokenswift_only(model_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 40)
    args = ["bench", "--model-dir", str(model_dir), "--prompt-file", str(text), "--gen-len", "24"]
    args += ["--prefix-len", "32", "--no-extras", "--out", str(tmp_path / "bench")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    row = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"][0]
    assert row["tokens_equal_ar"] and "distinct4_penalty" in row and row["auto_plans"]
    assert "distinct4_no_penalty" not in row and "auto_vs_default_tree" not in row
    assert "distinct4_no_penalty" not in result.stdout


def test_a_snapshots_decode_time_per_iteration_leaves_the_prefill_out():
    stats = Stats(method="tokenswift", seed=0, new_tokens=31, iterations=10, prefill_s=1.5)
    snapshot = Snapshot.of(stats, elapsed_s=2.0)
    assert snapshot.prefill_s == 1.5 and snapshot.decode_ms_per_iteration == pytest.approx(50.0)
    row = {"ar_decode_ms_per_iteration": 20.0, "tokenswift_decode_ms_per_iteration": 50.0}
    times = measured_iteration_times(row, 4.0)
    assert times["iteration_over_ar_step"] == 2.5 and times["modeled_speedup"] == pytest.approx(1.6)


def test_a_long_run_is_modeled_from_the_times_measured_at_each_prompt_length():
    # AR 10 -> 20 ms per token, an iteration 20 -> 80 ms, from a 1,000- to a 3,000-token context
    rows = [
        {"prefix_len": 3000, "ar_ms_per_token": 20.0, "tokenswift_ms_per_iteration": 80.0},
        {"prefix_len": 1000, "ar_ms_per_token": 10.0, "tokenswift_ms_per_iteration": 20.0},
        {"prefix_len": 2000, "ar_ms_per_token": 15.0, "tokenswift_ms_per_iteration": 40.0},
    ]
    run = modeled_long_run(rows, 4.0)
    assert (run["from_context"], run["to_context"], run["tokens"]) == (1000, 3000, 2000)
    assert run["ar_s"] == pytest.approx(1000 * 0.0125 + 1000 * 0.0175)  # 30 s
    assert run["tokenswift_s"] == pytest.approx((1000 * 0.030 + 1000 * 0.060) / 4)  # 22.5 s
    assert run["modeled_speedup"] == pytest.approx(30 / 22.5, rel=1e-3)
    assert modeled_long_run(rows[:1], 4.0) is None  # one prompt length: nothing to integrate


def test_bench_times_a_model_shape_with_random_weights_and_models_the_speedup(tmp_path):
    """`bench --random-weights`: whole generations of a preset's shape with no checkpoint or text
    (on a GPU: the 8B shape end to end); the row's times are the measured ones, and the modeled
    speedup is what an iteration of that cost gives at --accept-length tokens."""
    args = ["bench", "--model", "swift-tiny", "--random-weights", "--tree", "1,3", "--gen-len", "24,40"]
    args += ["--prefix-len", "16,32", "--no-extras", "--accept-length", "3", "--out", str(tmp_path / "rw")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "rw" / "bench.json").read_text())
    assert report["meta"]["random_weights"] and report["meta"]["accept_length"] == 3
    assert [(row["prefix_len"], row["gen_len"]) for row in report["rows"]] == [
        (16, 24),
        (16, 40),
        (32, 24),
        (32, 40),
    ]
    assert (
        report["meta"]["modeled_long_run"]["tokens"] == 16
        and "modeled generation of 16 tokens" in result.stdout
    )
    for row in report["rows"]:
        assert row["tokens_equal_ar"]
        # the times are decoding's alone: the prompt's prefill (seconds at a 100K prompt) is left out
        assert row["prefill_s"] > 0
        assert row["ar_ms_per_token"] == pytest.approx(row["ar_decode_ms_per_iteration"], rel=1e-3)
        assert 1e3 * row["gen_len"] / row["ar_tokens_per_s"] > row["ar_ms_per_token"] * (row["gen_len"] - 1)
        iteration = row["tokenswift_decode_ms_per_iteration"]
        assert row["tokenswift_ms_per_iteration"] == pytest.approx(iteration, rel=1e-3)
        assert row["modeled_speedup"] == pytest.approx(3 * row["ar_ms_per_token"] / iteration, rel=1e-2)
    assert "modeled_speedup" in result.stdout and "iteration_over_ar_step" in result.stdout
    for bad, message in (
        (["--tree", "auto"], "needs a static --tree"),
        (["--tree", "3", "--prompt-file", str(tmp_path / "x.txt")], "no --model-dir"),
        (["--tree", "3", "--accept-length", "0.5"], "--accept-length must be at least 1"),
        (["--tree", "3,3,3", "--accept-length", "4.36"], "more than tree 3,3,3 can commit"),
    ):
        refused = CliRunner().invoke(main, ["bench", "--model", "swift-tiny", "--random-weights", *bad])
        assert refused.exit_code == 2 and message in refused.output
    missing = CliRunner().invoke(main, ["bench", "--model", "swift-tiny"])
    assert missing.exit_code == 2 and "--prompt-file is required" in missing.output
    text = tmp_path / "book.txt"
    text.write_text("words " * 100)
    stray = CliRunner().invoke(
        main, ["bench", "--model", "swift-tiny", "--prompt-file", str(text), "--accept-length", "3"]
    )
    assert stray.exit_code == 2 and "give it with --random-weights" in stray.output
