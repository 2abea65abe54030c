"""Step-cost benchmark: measured steps on a tiny random model, the speedup model against hand
values, and `tokenswift-trt bench-steps` end to end."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tokenswift_trt.bench import steps
from tokenswift_trt.bench.steps import (
    PAPER_A100_LLAMA31_8B,
    StepBenchError,
    StepBytes,
    StepCost,
    interpolate,
    measure_step_costs,
    modeled_speedup,
    random_engine,
)
from tokenswift_trt.builder.presets import PRESETS
from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.cli import main
from tokenswift_trt.decode.admission import GIB, MemoryPlan, available_bytes

BANDWIDTH = 10e9  # bytes/s, fixed so that bandwidth times are exact


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("random-tiny"), seed=5)


@pytest.fixture(scope="module")
def engine(model_dir):
    return random_engine(str(model_dir), torch.float32, "cpu")[0]


def test_measured_steps_are_positive_and_bandwidth_grows_with_context(engine):
    costs = measure_step_costs(engine, [64, 256], [1, 8], kv_budget=128, repeats=3, bandwidth=BANDWIDTH)
    by_key = {(c.context, c.step): c for c in costs}
    assert set(by_key) == {
        (L, s) for L in (64, 256) for s in ("ar", "draft", "heads", "verify_T1", "verify_T8")
    }
    assert all(c.seconds > 0 and c.bandwidth_seconds > 0 for c in costs)
    assert by_key[64, "verify_T8"].tokens == 8 and by_key[64, "ar"].tokens == 1
    sizes = StepBytes.of(engine)
    config = engine.config
    assert sizes.kv_per_position == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    for step in ("ar", "verify_T1", "verify_T8"):  # the full cache: every position is read
        grown = by_key[256, step].bytes_read - by_key[64, step].bytes_read
        assert grown == 192 * sizes.kv_per_position
        assert by_key[256, step].bandwidth_seconds > by_key[64, step].bandwidth_seconds
    # the draft reads min(budget, context) positions: 64, then the budget of 128
    assert by_key[256, "draft"].bytes_read - by_key[64, "draft"].bytes_read == 64 * sizes.kv_per_position
    assert by_key[64, "draft"].bytes_read - by_key[64, "ar"].bytes_read == sizes.draft_layers
    assert by_key[64, "heads"].bytes_read == sizes.draft_layers + sizes.head
    assert by_key[64, "ar"].bandwidth_seconds == pytest.approx(by_key[64, "ar"].bytes_read / BANDWIDTH)


def test_fixed_shape_steps_are_measured_too(engine):
    """static_steps=True times the forwards generate() runs with static_steps (CUDA graphs on a GPU)."""
    costs = measure_step_costs(
        engine, [64], [1, 20], kv_budget=32, repeats=2, bandwidth=BANDWIDTH, static_steps=True
    )
    assert {c.step for c in costs} == {"ar", "draft", "heads", "verify_T1", "verify_T20"}
    assert all(c.seconds > 0 for c in costs)


@pytest.mark.slow  # one torch.compile per bucket: ~10 s each on 2 cores
def test_compiled_steps_are_measured_through_the_compiler(engine):
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    costs = measure_step_costs(
        engine, [64], [1, 16], kv_budget=32, repeats=2, bandwidth=BANDWIDTH, compile_steps=True
    )
    assert {c.step for c in costs} == {"ar", "draft", "heads", "verify_T1", "verify_T16"}
    assert counters["stats"]["unique_graphs"] > graphs


def test_bad_contexts_are_one_line_errors(engine):
    with pytest.raises(StepBenchError, match="maximum length"):
        measure_step_costs(engine, [engine.config.max_position_embeddings], [8], 128, 1, bandwidth=BANDWIDTH)
    with pytest.raises(StepBenchError, match="at least 2"):
        measure_step_costs(engine, [1], [1], 128, 1, bandwidth=BANDWIDTH)


@pytest.mark.slow
def test_a_context_that_does_not_fit_names_the_figures(engine, model_dir, monkeypatch):
    monkeypatch.setattr(steps, "available_bytes", lambda device: 1000)
    with pytest.raises(
        StepBenchError, match=r"context 256: its caches need \d+\.\d\d GiB but 0\.00 GiB is free on cpu"
    ):
        measure_step_costs(engine, [256], [8], 128, 1, bandwidth=BANDWIDTH)
    monkeypatch.undo()
    monkeypatch.setattr(steps, "plan_memory", lambda *args: MemoryPlan(0, 1 << 50, 0, 0, 1))
    result = CliRunner().invoke(
        main,
        [
            "bench-steps",
            "--model",
            str(model_dir),
            "--contexts",
            "64",
            "--tree-sizes",
            "1",
            "--step-repeats",
            "1",
        ],
    )
    assert result.exit_code == 2
    assert [line for line in result.stderr.splitlines() if "error" in line] == [
        "tokenswift-trt: error: context 64: its caches need 1048576.00 GiB but "
        f"{available_bytes(torch.device('cpu')) / GIB:.2f} GiB is free on cpu: measure smaller contexts"
    ]


def test_random_engine_has_the_preset_shape():
    engine, dtype = random_engine("swift-tiny", device="cpu")
    assert dtype == "float32" and engine.device == torch.device("cpu")
    assert sum(p.numel() for p in engine.model.parameters()) == PRESETS["swift-tiny"].parameter_count()
    assert len(engine.draft_layers) == engine.config.num_draft_layers
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())
    with pytest.raises(ValueError, match="unknown model"):
        random_engine("no-such-model")


def _constant_costs(
    contexts=(1000,), ar=0.010, draft=0.005, heads=0.001, verify=0.012, tree=41
) -> list[StepCost]:
    return [
        StepCost(L, step, 1, seconds, 0, 0.0)
        for L in contexts
        for step, seconds in (("ar", ar), ("draft", draft), ("heads", heads), (f"verify_T{tree}", verify))
    ]


def test_constant_costs_give_the_hand_computed_speedup():
    rows = modeled_speedup(_constant_costs(), 4096, [20480, 102400], 3.0, 2.0, 41)
    assert [(r.gen_length, r.mode) for r in rows] == [
        (20480, "partial"),
        (20480, "verify"),
        (102400, "partial"),
        (102400, "verify"),
    ]
    for row in rows:
        if row.mode == "partial":  # 3 tokens per 5 + 12 ms iteration vs 10 ms per AR token
            assert row.speedup == pytest.approx(30 / 17, rel=1e-9)
        else:  # 2 tokens per 1 + 12 ms iteration
            assert row.speedup == pytest.approx(20 / 13, rel=1e-9)
        assert row.ar_seconds == pytest.approx(row.gen_length * 0.010)
    with_host = modeled_speedup(_constant_costs(), 0, [300], 3.0, 3.0, 41, host_overhead_s=0.003)
    assert with_host[0].speedup == pytest.approx(30 / 20) and with_host[
        0
    ].tokenswift_seconds == pytest.approx(2.0)


def test_interpolation_and_extrapolation_by_hand():
    points = [(100, 0.010), (200, 0.020), (400, 0.030)]
    at = np.array([100, 150, 200, 300, 400, 600, 50, 0])
    expected = [0.010, 0.015, 0.020, 0.025, 0.030, 0.040, 0.005, 0.0]
    assert interpolate(points, at) == pytest.approx(expected)
    assert interpolate([(100, 0.5)], np.array([1, 10_000])) == pytest.approx([0.5, 0.5])
    # a falling end segment (timing noise) is extended flat, never downwards
    assert interpolate([(100, 0.020), (200, 0.010)], np.array([400, 50])) == pytest.approx([0.010, 0.020])


def test_linear_ar_cost_sums_over_generated_tokens():
    # ar(L) = L µs: N tokens from context P cost Σ_{i<N} (P + i) µs
    costs = [StepCost(L, "ar", 1, L * 1e-6, 0, 0.0) for L in (100, 200)]
    costs += [StepCost(L, s, 1, 0.001, 0, 0.0) for L in (100, 200) for s in ("draft", "heads", "verify_T8")]
    prompt, n = 150, 100
    row = modeled_speedup(costs, prompt, [n], 2.0, 2.0, 8)[0]
    assert row.ar_seconds == pytest.approx(sum(prompt + i for i in range(n)) * 1e-6)
    assert row.tokenswift_seconds == pytest.approx(n * 0.002 / 2.0)
    with pytest.raises(StepBenchError, match="verify_T41"):
        modeled_speedup(costs, prompt, [n], 2.0, 2.0, 41)
    with pytest.raises(StepBenchError, match=">= 1"):
        modeled_speedup(costs, prompt, [n], 0.5, 2.0, 8)
    # no model assumes more tokens per iteration than its tree commits (1,3,3,3: 5; 3,3,3: 4)
    with pytest.raises(StepBenchError, match="verify-pass drafting is more than its tree commits"):
        modeled_speedup(costs, prompt, [n], 4.36, 4.36, 8)
    with pytest.raises(StepBenchError, match="partial-cache drafting is more than"):
        modeled_speedup(costs, prompt, [n], 5.5, 2.0, 8)
    assert modeled_speedup(costs, prompt, [n], 5.0, 4.0, 8)  # at the caps


@pytest.mark.slow
def test_cli_writes_the_step_report(model_dir, tmp_path):
    out = tmp_path / "steps"
    result = CliRunner().invoke(
        main,
        [
            "bench-steps",
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--contexts",
            "64,128",
            "--tree-sizes",
            "1,4",
            "--kv-budget",
            "64",
            "--step-repeats",
            "3",
            "--gen-len",
            "256,512",
            "--prefix-len",
            "64",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    steps = list(csv.DictReader(open(out / "steps.csv")))
    assert {(r["context"], r["step"]) for r in steps} == {
        (L, s) for L in ("64", "128") for s in ("ar", "draft", "heads", "verify_T1", "verify_T4")
    }
    assert all(float(r["ms"]) > 0 and float(r["bandwidth_ms"]) > 0 for r in steps)
    speedup = list(csv.DictReader(open(out / "speedup.csv")))
    assert [(r["gen_length"], r["mode"]) for r in speedup] == [
        ("256", "partial"),
        ("256", "verify"),
        ("512", "partial"),
        ("512", "verify"),
    ]
    assert all(float(r["speedup"]) > 0 and r["tree_size"] == "4" for r in speedup)
    report = json.loads((out / "steps.json").read_text())
    meta = report["meta"]
    assert meta["dtype"] == "float32" and meta["torch"] == torch.__version__ and "CPU" in meta["device"]
    assert meta["command"].startswith("tokenswift-trt bench-steps") and meta["model"] == str(model_dir)
    assert meta["host_overhead_measured"] and meta["host_overhead_ms"] > 0  # measured by a short generation
    assert len(report["steps"]) == 10 and len(report["speedup"]) == 4
    assert report["paper_a100_llama3.1_8b"] == {str(k): v for k, v in PAPER_A100_LLAMA31_8B.items()}
    assert not list(out.glob("*.png"))  # plots are tools.plot_benchmarks --run's
    assert "verify_T4 ms (floor)" in result.stdout and "speedup partial" in result.stdout


def test_cli_step_mode_errors_are_one_line(model_dir):
    runner = CliRunner()
    if not torch.cuda.is_available():
        cuda = runner.invoke(main, ["bench-steps", "--model", "swift-tiny", "--device", "cuda"])
        assert cuda.exit_code == 2
        assert cuda.stderr.strip().splitlines() == [
            "tokenswift-trt: error: bench-steps: --device cuda needs a CUDA GPU and a CUDA build of torch "
            + ("(this torch is CPU-only)" if torch.version.cuda is None else "(no CUDA GPU is visible)")
        ]
    too_long = runner.invoke(main, ["bench-steps", "--model", "swift-tiny", "--contexts", "40000"])
    assert too_long.exit_code == 2 and too_long.stderr.strip().splitlines() == [
        "tokenswift-trt: error: context 40000 + tree 121 exceeds the model's maximum length 32768"
    ]
    no_prompt = runner.invoke(main, ["bench", "--model", "swift-tiny"])  # whole generations need a text
    assert no_prompt.exit_code == 2 and "--prompt-file" in no_prompt.stderr
    unknown = runner.invoke(main, ["bench-steps", "--model", "nope"])
    assert unknown.exit_code == 2 and "unknown model 'nope'" in unknown.stderr
    bad_tree = runner.invoke(
        main, ["bench-steps", "--model", str(model_dir), "--tree-sizes", "1,4", "--verify-tree-size", "9"]
    )
    assert bad_tree.exit_code == 2 and "--verify-tree-size 9" in bad_tree.stderr


def test_accept_lengths_are_measured_by_generation(model_dir):
    partial, verify = steps.measure_accept_lengths(model_dir, gen_tokens=40)
    assert partial >= 1 and verify >= 1  # tokens committed per iteration, accepted + 1
