"""One `train-heads` run as a library call: read the text, load the base model, start or resume the
trainer from its checkpoint, train, write the heads file, its report and optionally the combined
checkpoint.

    job = TrainHeadsJob(model_dir, data=(Path("corpus.jsonl"),), out=Path("runs/heads"))
    training = start_training(job)          # every check, the model loaded, a checkpoint resumed
    outcome = training.run(on_step=print)   # OUT/heads.safetensors, OUT/train_heads.json, OUT/report.png

The CLI's `train-heads` is these two calls plus printing. Every failure is a `TrainingError` whose first
line says what is wrong and the fix. Under torchrun, `start_training(job, join_ranks(job.device))` on
every rank trains data-parallel (training/ranks.py); rank 0 writes the files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.api import ApiError, load
from tokenswift_trt.environment import machine_meta
from tokenswift_trt.model.config import ConfigError, load_config
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.tensor_parallel import (
    TensorParallel,
    TensorParallelError,
    check_size,
    parameter_bytes,
)
from tokenswift_trt.training.data import read_records, token_splits
from tokenswift_trt.training.errors import TrainingError
from tokenswift_trt.training.ranks import Ranks
from tokenswift_trt.training.report import plot_report
from tokenswift_trt.training.train_heads import (
    CHECKPOINT,
    HEADS_FILE,
    DraftAccuracy,
    HeadsTrainer,
    TrainHeadsConfig,
    accuracy_figures,
    draft_accuracy,
    evaluation_sequences,
    save_heads,
    write_combined,
)

REPORT_FILE = "train_heads.json"
PLOT_FILE = "report.png"


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
    # the frozen base split over the torchrun ranks (tensor parallel: each holds a slice of every
    # layer, for a model one device cannot hold); the draft layers still train data-parallel
    split_base: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    field: str = "text"  # the text's column in .jsonl/.parquet/.csv data
    threads: int | None = None  # CPU threads of the base model's kernels (None: the default)
    command: str = ""  # the command line, as the report records it


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
    ranks: Ranks = Ranks()

    @property
    def draft_layer_count(self) -> int:
        return len(self.engine.draft_layers)

    def run(
        self,
        on_step: Callable[[int, float], None] | None = None,
        on_cached_state: Callable[[int], None] | None = None,
    ) -> TrainHeadsOutcome | None:
        """The whole run: `cache_states`, `train`, `finish` (None on ranks other than 0)."""
        self.cache_states(on_cached_state)
        self.train(on_step)
        return self.finish()

    def cache_states(self, on_cached_state: Callable[[int], None] | None = None) -> None:
        """Build the base-state cache now (`state_cache` > 0; else nothing), `on_cached_state(done)`
        called per sequence."""
        if self.job.config.state_cache:
            self.trainer.cache_states(on_cached_state)

    def train(
        self,
        on_step: Callable[[int, float], None] | None = None,
        on_evaluation: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Train to `config.steps`, checkpointing on the way; `on_step(step, loss)` per optimiser step,
        `on_evaluation(figures)` per held-out evaluation (`eval_every`, rank 0)."""
        # a split base's forwards take every rank: they all evaluate, rank 0 reports
        scores = self.ranks.main or self.job.split_base
        main = self.ranks.main
        self.trainer.run(on_step, self.evaluate if scores else None, on_evaluation if main else None)

    def evaluate(self, sequences: int | None = None) -> DraftAccuracy:
        """The layers scored on the first `sequences` held-out sequences (`progress_sequences`)."""
        config = self.job.config
        count = config.progress_sequences if sequences is None else sequences
        chosen = evaluation_sequences(self.eval_ids, config.seq_len, count)
        return draft_accuracy(self.engine, self.trainer.draft_layers, chosen, config.teacher)

    def finish(self) -> TrainHeadsOutcome | None:
        """Write the heads file, score the layers on the held-out text, write the report, its plot (and
        the combined checkpoint where asked). Rank 0 only (with a split base every rank evaluates, its
        forwards take them all): the others return None."""
        job, config, trainer = self.job, self.job.config, self.trainer
        trainer.draft_layers.eval()
        if self.ranks.main or job.split_base:
            accuracy = self.evaluate(config.eval_sequences)
        if not self.ranks.main:
            return None
        heads_path = job.out / HEADS_FILE
        save_heads(trainer.draft_layers, heads_path)
        report = {
            "meta": {**machine_meta(), "command": job.command},
            "steps": trainer.step,
            "final_loss": trainer.last_loss,
            **accuracy_figures(accuracy),
            "path_top1": accuracy.path_layers,
            "path_agrees_with_base": accuracy.path_agreement,
            "init_heads": None if job.init_heads is None else str(job.init_heads),
            "train_tokens": self.train_ids.numel(),
            "eval_tokens": self.eval_ids.numel(),
            "ranks": self.ranks.size,
            "split_base": job.split_base,
            "base_bytes_per_rank": parameter_bytes(self.engine.model),  # rank 0's share with a split base
            "global_batch": config.batch * config.grad_accum,  # sequences per optimiser step
            "config": dict(vars(config)),
            "history": trainer.history,
            "evaluations": trainer.evaluations,
        }
        report_path = job.out / REPORT_FILE
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        plot_report(report, job.out / PLOT_FILE)
        if job.combined is not None:
            write_combined(job.model_dir, heads_path, job.combined)
        return TrainHeadsOutcome(heads_path, report_path, job.combined, accuracy, report)


def start_training(job: TrainHeadsJob, ranks: Ranks = Ranks()) -> Training:
    """Check the job, read its text, load the base model and build the trainer (from OUT's checkpoint
    with `resume`). Bad settings and unreadable text fail before the model loads. `ranks`: this
    process's place in a data-parallel run (`training.ranks.join_ranks`)."""
    job.config.validate()
    records = read_records(list(job.data), job.field)
    eval_records = read_records(list(job.eval_data), job.field) if job.eval_data else []
    if not job.model_dir.is_dir():
        raise TrainingError(f"model directory {job.model_dir} does not exist")
    if (job.out / CHECKPOINT).exists() and not (job.resume or job.force):
        raise TrainingError(
            f"{job.out} holds a checkpoint: pass --resume to continue it or --force to start over"
        )
    kernels = None if job.threads is None else {"threads": str(job.threads)}
    tp = None
    if job.split_base:
        if ranks.size == 1:
            raise TrainingError(
                "--split-base splits the base over torchrun's ranks: launch with "
                "`torchrun --nproc-per-node N -m tokenswift_trt train-heads ... --split-base`"
            )
        # every rank keeps the whole LM head: the layers' loss reads all of its rows
        tp = TensorParallel(ranks.rank, ranks.size, head="replicated")
        try:
            check_size(load_config(job.model_dir), ranks.size)
        except (ConfigError, TensorParallelError) as error:
            raise TrainingError(str(error).splitlines()[0]) from None
    try:
        model = load(
            model_dir=job.model_dir, dtype=job.dtype, device=ranks.device(job.device), kernels=kernels, tp=tp
        )
    except ApiError as error:
        raise TrainingError(str(error)) from None
    engine = model.engine
    eos = engine.config.eos_token_ids[:1]
    train_ids, eval_ids = token_splits(records, eval_records, model.codec.encode, eos)
    if ranks.main:
        job.out.mkdir(parents=True, exist_ok=True)
    trainer = HeadsTrainer(engine, train_ids, job.config, job.out, job.init_heads, ranks, job.split_base)
    if job.resume:
        trainer.load_checkpoint()
    return Training(job, engine, trainer, train_ids, eval_ids, model.fallbacks, ranks)
