"""`bench.step_bench`, the library call under `bench-steps`: one row per (context, step), one modeled
speedup per (generation length, drafting mode), the report written, and bad jobs refused before any
weights are built."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest

from tokenswift_trt.bench.step_bench import StepBenchJob, run_step_bench
from tokenswift_trt.bench.steps import StepBenchError, StepCost
from tokenswift_trt.builder.random_model import write_random_model


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> StepBenchJob:
    root = tmp_path_factory.mktemp("step-bench")
    model_dir = write_random_model(root / "model", seed=5)
    return StepBenchJob(
        model=str(model_dir),
        contexts=(64, 128),
        tree_sizes=(1, 4),
        gen_lens=(256, 512),
        prompt_length=64,
        host_overhead_ms=0.5,
        step_repeats=2,
        kv_budget=64,
        out=root / "steps",
        command="test",
    )


def test_the_report_holds_a_row_per_context_and_step_and_a_speedup_per_length_and_mode(job):
    seen: list[StepCost] = []
    notes: list[str] = []
    result = run_step_bench(job, seen.append, notes.append)
    pairs = [(cost.context, cost.step) for cost in result.costs]
    expected = {(L, s) for L in (64, 128) for s in ("ar", "draft", "heads", "verify_T1", "verify_T4")}
    assert set(pairs) == expected and len(pairs) == 10
    assert [(c.context, c.step) for c in seen] == pairs  # every measured step reported as it is done
    assert all(cost.seconds > 0 and cost.bandwidth_seconds > 0 for cost in result.costs)
    assert [(s.gen_length, s.mode) for s in result.speedups] == [
        (256, "partial"),
        (256, "verify"),
        (512, "partial"),
        (512, "verify"),
    ]
    assert all(s.tree_size == 4 and s.speedup > 0 for s in result.speedups)  # the largest tree size
    assert result.accept_length == job.accept_length and result.verify_accept_length == 4  # capped
    assert result.host_overhead_ms == 0.5 and not notes  # given, so not measured (nothing to say)
    assert result.extrapolated == (128, 576)  # 64 + 512 tokens modeled from contexts up to 128

    assert [p.name for p in result.written] == ["steps.csv", "speedup.csv", "steps.json"]
    rows = list(csv.DictReader(open(job.out / "steps.csv")))
    assert [(int(r["context"]), r["step"]) for r in rows] == pairs
    meta = json.loads((job.out / "steps.json").read_text())["meta"]
    assert meta["command"] == "test" and meta["model"] == job.model and meta["kv_budget"] == 64
    assert meta["host_overhead_ms"] == 0.5 and meta["host_overhead_measured"] is False
    assert meta["verify_tree_size"] == 4 and meta["dtype"] == "float32"


def test_the_host_overhead_is_measured_and_said_when_not_given(job, tmp_path):
    notes: list[str] = []
    measured = replace(job, contexts=(64,), tree_sizes=(4,), gen_lens=(64,), host_overhead_ms=None)
    result = run_step_bench(replace(measured, out=tmp_path), note=notes.append)
    assert result.host_overhead_ms > 0 and result.meta["host_overhead_measured"] is True
    assert result.extrapolated == (64, 128)
    assert [line.split(":")[0] for line in notes] == ["host overhead"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"verify_tree_size": 9}, "--verify-tree-size 9 is not among --tree-sizes 1,4"),
        ({"accept_length": 0.5}, "must be >= 1"),
        ({"step_repeats": 0}, "must be >= 1"),
        ({"acceptance_from": "missing"}, "does not exist"),
        ({"model": "nope"}, "nope"),
    ],
)
def test_bad_jobs_are_one_line_errors(job, tmp_path, change, message):
    if change.get("acceptance_from"):
        change = {"acceptance_from": tmp_path / "missing"}
    with pytest.raises(ValueError, match=message) as caught:
        run_step_bench(replace(job, out=tmp_path / "out", **change))
    assert isinstance(caught.value, StepBenchError) or "model" in change
    assert not (tmp_path / "out").exists()
