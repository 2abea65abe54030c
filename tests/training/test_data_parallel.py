"""`train-heads` under torchrun: two gloo ranks on the CPU train on the same global batch as one
process, so they give its loss curve and layers (within float rounding), and a run interrupted in one
process resumes on two ranks to the same layers."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.training.errors import TrainingError
from tokenswift_trt.training.ranks import Ranks
from tokenswift_trt.training.run import REPORT_FILE, TrainHeadsJob, start_training
from tokenswift_trt.training.train_heads import CHECKPOINT, HEADS_FILE, TrainHeadsConfig

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


class Interrupted(Exception):
    pass


def _cli_args(job: TrainHeadsJob, out) -> list[str]:
    config = job.config
    return [
        "-m",
        "tokenswift_trt",
        "train-heads",
        "--model-dir",
        str(job.model_dir),
        "--data",
        str(job.data[0]),
        "--out",
        str(out),
        "--steps",
        str(config.steps),
        "--seq-len",
        str(config.seq_len),
        "--batch",
        str(config.batch),
        "--grad-accum",
        str(config.grad_accum),
        "--warmup-steps",
        str(config.warmup_steps),
        "--checkpoint-every",
        str(config.checkpoint_every),
        "--eval-every",
        str(config.eval_every),
        "--state-cache",
        str(config.state_cache),
        "--loss",
        config.loss,
    ]


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run([*TORCHRUN, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _assert_same_layers(first, second, atol: float = 1e-6) -> None:
    a, b = load_file(str(first)), load_file(str(second))
    assert a.keys() == b.keys()
    for key, value in a.items():
        torch.testing.assert_close(value, b[key], rtol=1e-4, atol=atol, msg=key)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> TrainHeadsJob:
    root = tmp_path_factory.mktemp("data-parallel")
    data = root / "data.jsonl"
    lines = [
        f'{{"text": "line {i}: the cat sat on the mat {i % 7}; the dog sat on the log."}}' for i in range(80)
    ]
    data.write_text("\n".join(lines) + "\n")
    # 3 sequences per step: rank 0 takes two of them and rank 1 one, the sum is still the step's
    config = TrainHeadsConfig(
        steps=4,
        seq_len=32,
        batch=3,
        grad_accum=1,
        warmup_steps=1,
        checkpoint_every=2,
        eval_every=2,
        loss="sampled",
        state_cache=5,
    )
    return TrainHeadsJob(write_random_model(root / "model", seed=3), (data,), root / "one", config)


@pytest.mark.slow
def test_two_ranks_train_the_layers_of_one_process_and_resume_across_rank_counts(job, tmp_path):
    one = start_training(job).run()
    assert one is not None
    history = one.report["history"]
    assert [entry["step"] for entry in history] == [1, 2, 3, 4]
    assert [entry["step"] for entry in one.report["evaluations"]] == [2, 4]
    assert one.report["ranks"] == 1 and one.report["global_batch"] == 3
    assert (job.out / "report.png").stat().st_size > 0

    two = tmp_path / "two"
    launched = _torchrun(_cli_args(job, two))
    assert "over 2 ranks" in launched.stderr and launched.stderr.count("heads file:") == 0
    report = json.loads((two / REPORT_FILE).read_text())
    assert report["ranks"] == 2 and report["global_batch"] == 3
    ranked = [entry["loss"] for entry in report["history"]]
    assert ranked == pytest.approx([entry["loss"] for entry in history], rel=1e-4)
    assert ranked[0] != pytest.approx(ranked[-1])  # the layers learnt something
    first = report["evaluations"][0]["draft_coupled_acceptance"]
    assert first == pytest.approx(one.report["evaluations"][0]["draft_coupled_acceptance"], abs=1e-4)
    _assert_same_layers(job.out / HEADS_FILE, two / HEADS_FILE)

    # interrupted in one process after its step-2 checkpoint, resumed on two ranks
    interrupted = replace(job, out=tmp_path / "resumed")

    def stop_at_step_3(step: int, loss: float) -> None:
        if step == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        start_training(interrupted).train(stop_at_step_3)
    assert torch.load(interrupted.out / CHECKPOINT, weights_only=True)["step"] == 2
    resumed = _torchrun([*_cli_args(job, interrupted.out), "--resume"])
    assert "from step 2" in resumed.stderr
    again = json.loads((interrupted.out / REPORT_FILE).read_text())
    assert [e["step"] for e in again["history"]] == [1, 2, 3, 4]
    assert [e["loss"] for e in again["history"]] == pytest.approx([e["loss"] for e in history], rel=1e-4)
    _assert_same_layers(job.out / HEADS_FILE, interrupted.out / HEADS_FILE)


@pytest.mark.slow
@pytest.mark.parametrize("state_cache", [0, 5])
def test_the_base_split_over_two_ranks_trains_the_layers_of_one_process(job, tmp_path, state_cache):
    # state_cache 0: every step's base forwards are made by both ranks together, then shared out;
    # 5: the cache's states are, once
    single = replace(job, out=tmp_path / "one", config=replace(job.config, state_cache=state_cache))
    one = start_training(single).run()
    assert one is not None and not one.report["split_base"]
    split = tmp_path / "split"
    launched = _torchrun([*_cli_args(single, split), "--split-base"])
    assert "over 2 ranks (the base split between them)" in launched.stderr
    report = json.loads((split / REPORT_FILE).read_text())
    assert report["ranks"] == 2 and report["split_base"]
    # rank 0 held half of every layer's projections (the embedding, norms and head whole)
    assert report["base_bytes_per_rank"] < 0.8 * one.report["base_bytes_per_rank"]
    ranked = [entry["loss"] for entry in report["history"]]
    assert ranked == pytest.approx([entry["loss"] for entry in one.report["history"]], rel=1e-4)
    for mine, theirs in zip([*report["evaluations"], report], [*one.report["evaluations"], one.report]):
        assert mine["draft_coupled_acceptance"] == pytest.approx(theirs["draft_coupled_acceptance"], abs=1e-4)
    # the split base's states differ from one process's in the last bits (its all-reduces sum in
    # another order; a float16 cache can round a state the other way), and Adam's normalised steps
    # carry that to up to ~6e-4 in a few of the ~1e-2 weights
    _assert_same_layers(single.out / HEADS_FILE, split / HEADS_FILE, atol=1e-3)


def test_a_split_base_outside_torchrun_is_refused_in_one_line(job, tmp_path):
    with pytest.raises(TrainingError, match="launch with `torchrun --nproc-per-node N"):
        start_training(replace(job, out=tmp_path / "alone", split_base=True))


def test_a_rank_takes_every_size_th_sequence_and_its_own_gpu():
    sequences = list(range(7))
    assert Ranks(0, 2).share(sequences) == [0, 2, 4, 6] and Ranks(1, 2).share(sequences) == [1, 3, 5]
    assert Ranks(1, 3, local_rank=1).device("cuda") == "cuda:1" and Ranks(1, 3).device("cpu") == "cpu"
    assert Ranks().device("cuda") == "cuda" and Ranks().main and not Ranks(1, 2).main
