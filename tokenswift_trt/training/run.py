"""One `train-heads` run as a library call: read the text, load the base model, start or resume the
trainer from its checkpoint, train, write the heads file, its report and optionally the combined
checkpoint.

    job = TrainHeadsJob(model_dir, data=(Path("corpus.jsonl"),), out=Path("runs/heads"))
    training = start_training(job)          # every check, the model loaded, a checkpoint resumed
    outcome = training.run(on_step=print)   # OUT/heads.safetensors, OUT/train_heads.json

The CLI's `train-heads` is these two calls plus printing. Every failure is a `TrainingError` whose first
line says what is wrong and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.api import ApiError, load
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.training.train_heads import (
    CHECKPOINT,
    HEADS_FILE,
    DraftAccuracy,
    HeadsTrainer,
    TrainHeadsConfig,
    TrainingError,
    draft_accuracy,
    evaluation_sequences,
    read_texts,
    save_heads,
    token_splits,
    write_combined,
)

REPORT_FILE = "train_heads.json"


@dataclass(frozen=True)
class TrainHeadsJob:
    """What `train-heads` is asked: the base model, the text, where the run lives and its settings."""

    model_dir: Path  # the base Hugging Face model directory
    data: tuple[Path, ...]  # .txt/.jsonl files or folders
    out: Path  # the heads file, the checkpoint and the report go here
    config: TrainHeadsConfig = field(default_factory=TrainHeadsConfig)
    eval_data: tuple[Path, ...] = ()  # held-out text (empty: the last 5% of `data`)
    init_heads: Path | None = None  # start from these trained layers instead of zero
    resume: bool = False  # continue from OUT/checkpoint.pt
    force: bool = False  # start over although OUT holds a checkpoint
    combined: Path | None = None  # also write base + heads in the released TokenSwift format here
    dtype: str = "float32"
    device: str = "cpu"


@dataclass
class TrainHeadsOutcome:
    """A finished run: the files written, the held-out figures and the report as written."""

    heads_path: Path
    report_path: Path
    combined: Path | None
    accuracy: DraftAccuracy
    report: dict[str, Any]


@dataclass
class Training:
    """A run ready to train: the base model loaded, the trainer at step 0 or at its checkpoint's."""

    job: TrainHeadsJob
    engine: Engine
    trainer: HeadsTrainer
    train_ids: torch.Tensor  # [train tokens]
    eval_ids: torch.Tensor  # [held-out tokens]
    fallbacks: list[str]  # kernels that run as their reference here (the CLI says them on stderr)

    @property
    def draft_layer_count(self) -> int:
        return len(self.engine.draft_layers)

    def run(
        self,
        on_step: Callable[[int, float], None] | None = None,
        on_cached_state: Callable[[int], None] | None = None,
    ) -> TrainHeadsOutcome:
        """The whole run: `cache_states`, `train`, `finish`."""
        self.cache_states(on_cached_state)
        self.train(on_step)
        return self.finish()

    def cache_states(self, on_cached_state: Callable[[int], None] | None = None) -> None:
        """Build the base-state cache now (`state_cache` > 0; else nothing), `on_cached_state(done)`
        called per sequence."""
        if self.job.config.state_cache:
            self.trainer.cache_states(on_cached_state)

    def train(self, on_step: Callable[[int, float], None] | None = None) -> None:
        """Train to `config.steps`, checkpointing on the way; `on_step(step, loss)` per optimiser step."""
        self.trainer.run(on_step)

    def finish(self) -> TrainHeadsOutcome:
        """Write the heads file, score the layers on the held-out text, write the report (and the
        combined checkpoint where asked)."""
        job, config, trainer = self.job, self.job.config, self.trainer
        heads_path = job.out / HEADS_FILE
        save_heads(trainer.draft_layers, heads_path)
        trainer.draft_layers.eval()
        accuracy = draft_accuracy(
            self.engine,
            trainer.draft_layers,
            evaluation_sequences(self.eval_ids, config.seq_len, 8),
            config.teacher,
        )
        report = {
            "steps": trainer.step,
            "final_loss": trainer.last_loss,
            "base_top1": accuracy.base,
            "draft_top1": accuracy.layers,
            "draft_agrees_with_base": accuracy.agreement,
            "path_top1": accuracy.path_layers,
            "path_agrees_with_base": accuracy.path_agreement,
            # under the --teacher-* sampling settings: the chance a layer's first draft is the sample
            "draft_coupled_acceptance": accuracy.acceptance,
            "init_heads": None if job.init_heads is None else str(job.init_heads),
            "train_tokens": self.train_ids.numel(),
            "eval_tokens": self.eval_ids.numel(),
            "config": dict(vars(config)),
        }
        report_path = job.out / REPORT_FILE
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        if job.combined is not None:
            write_combined(job.model_dir, heads_path, job.combined)
        return TrainHeadsOutcome(heads_path, report_path, job.combined, accuracy, report)


def start_training(job: TrainHeadsJob) -> Training:
    """Check the job, read its text, load the base model and build the trainer (from OUT's checkpoint
    with `resume`). Bad settings and unreadable text fail before the model loads."""
    job.config.validate()
    texts = read_texts(list(job.data))
    eval_texts = read_texts(list(job.eval_data)) if job.eval_data else []
    if not job.model_dir.is_dir():
        raise TrainingError(f"model directory {job.model_dir} does not exist")
    if (job.out / CHECKPOINT).exists() and not (job.resume or job.force):
        raise TrainingError(
            f"{job.out} holds a checkpoint: pass --resume to continue it or --force to start over"
        )
    try:
        model = load(model_dir=job.model_dir, dtype=job.dtype, device=job.device)
    except ApiError as error:
        raise TrainingError(str(error)) from None
    engine = model.engine
    train_ids, eval_ids = token_splits(texts, eval_texts, model.codec.encode, engine.config.eos_token_ids[:1])
    job.out.mkdir(parents=True, exist_ok=True)
    trainer = HeadsTrainer(engine, train_ids, job.config, job.out, job.init_heads)
    if job.resume:
        trainer.load_checkpoint()
    return Training(job, engine, trainer, train_ids, eval_ids, model.fallbacks)
