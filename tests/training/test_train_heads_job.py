"""`training.run`, the library call under `train-heads`: a run interrupted after its checkpoint and
resumed writes the same heads file and report as one that ran straight through."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.training.run import TrainHeadsJob, start_training
from tokenswift_trt.training.train_heads import CHECKPOINT, HEADS_FILE, TrainHeadsConfig, TrainingError


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> TrainHeadsJob:
    root = tmp_path_factory.mktemp("train-heads-job")
    data = root / "data.jsonl"
    data.write_text(
        "\n".join('{"text": "the cat sat on the mat. the dog sat on the log."}' for _ in range(40))
    )
    config = TrainHeadsConfig(steps=4, seq_len=32, grad_accum=1, warmup_steps=1, checkpoint_every=2)
    return TrainHeadsJob(write_random_model(root / "model", seed=2), (data,), root / "straight", config)


def test_a_resumed_run_writes_the_heads_and_report_of_one_run_straight_through(job, tmp_path):
    straight = start_training(job)
    assert straight.trainer.step == 0 and straight.draft_layer_count == 3
    losses: list[tuple[int, float]] = []
    outcome = straight.run(on_step=lambda step, loss: losses.append((step, loss)))
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    assert outcome.heads_path == job.out / HEADS_FILE and outcome.combined is None
    written = json.loads(outcome.report_path.read_text())
    assert written == json.loads(json.dumps(outcome.report))  # the report returned is the one written
    assert written["steps"] == 4 and written["final_loss"] == losses[-1][1]
    assert written["train_tokens"] == straight.train_ids.numel() > 0 < written["eval_tokens"]
    assert written["config"]["checkpoint_every"] == 2

    interrupted = replace(job, out=tmp_path / "run")

    def stop_after_step_3(step: int, loss: float) -> None:
        if step == 3:  # the checkpoint of step 2 is on disk, step 3 is lost
            raise Interrupted

    with pytest.raises(Interrupted):
        start_training(interrupted).train(stop_after_step_3)
    assert (interrupted.out / CHECKPOINT).is_file()
    with pytest.raises(TrainingError, match="--resume"):  # neither --resume nor --force
        start_training(interrupted)

    resumed = start_training(replace(interrupted, resume=True))
    assert resumed.trainer.step == 2
    again = resumed.run()
    assert again.report["final_loss"] == outcome.report["final_loss"]
    assert again.report["draft_top1"] == outcome.report["draft_top1"]
    heads, resumed_heads = load_file(str(outcome.heads_path)), load_file(str(again.heads_path))
    assert heads.keys() == resumed_heads.keys()
    for key, value in heads.items():
        assert torch.equal(value, resumed_heads[key]), key

    assert start_training(replace(interrupted, force=True)).trainer.step == 0  # --force starts over
    with pytest.raises(TrainingError, match="steps"):  # settings that differ from the checkpoint's
        start_training(replace(interrupted, resume=True, config=replace(job.config, steps=6)))


def test_bad_jobs_fail_before_the_model_loads(job, tmp_path):
    with pytest.raises(TrainingError, match="does not exist"):
        start_training(replace(job, data=(tmp_path / "none.txt",)))
    with pytest.raises(TrainingError, match="model directory"):
        start_training(replace(job, model_dir=tmp_path / "no-model", out=tmp_path / "out"))
    with pytest.raises(TrainingError, match="state cache"):
        start_training(replace(job, config=replace(job.config, state_cache=-1)))
    assert not (tmp_path / "out").exists()
