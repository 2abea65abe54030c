"""`train-heads`: train the three chained draft layers of a model with its base frozen."""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from .common import DTYPES, CliError, dataset_option, fail, field_option, given_command, resolve_source


@click.command("train-heads")
@click.option(
    "--model-dir", type=click.Path(path_type=Path), required=True, help="base Hugging Face model directory"
)
@dataset_option("--data", "training text (a `train-data` output trains on the tokens the model wrote)")
@dataset_option("--eval-data", "held-out text (default: the last 5% of --data)", required=False)
@field_option
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    help="output folder (heads file, checkpoint, report)",
)
@click.option("--steps", type=int, default=400, show_default=True)
@click.option("--seq-len", type=int, default=2048, show_default=True)
@click.option("--batch", type=int, default=1, show_default=True, help="sequences per micro-batch")
@click.option("--grad-accum", type=int, default=4, show_default=True)
@click.option("--lr", type=float, default=5e-3, show_default=True)
@click.option("--warmup-steps", type=int, default=50, show_default=True)
@click.option("--checkpoint-every", type=int, default=100, show_default=True)
@click.option(
    "--eval-every",
    type=int,
    default=0,
    show_default=True,
    help="score the layers on held-out text every N steps (progress bar, report.json, report.png); 0: only "
    "at the end",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--loss",
    type=click.Choice(["distill", "sampled", "coupled", "tokens"]),
    default="distill",
    show_default=True,
    help="distill: the base model's own distribution per token; sampled: that distribution after the "
    "sampling transforms (--teacher-*), what verification draws from; coupled: how often the first draft "
    "is that draw under the same noise (acceptance itself), same teacher; tokens: the corpus token "
    "(the paper's)",
)
@click.option(
    "--teacher-min-p", type=float, default=0.1, show_default=True, help="--loss sampled / coupled: min-p"
)
@click.option(
    "--teacher-penalty",
    type=float,
    default=1.2,
    show_default=True,
    help="--loss sampled / coupled: penalty θ (1: none)",
)
@click.option(
    "--teacher-window",
    type=int,
    default=256,
    show_default=True,
    help="--loss sampled / coupled: the penalty's window W in tokens",
)
@click.option(
    "--init-heads",
    type=click.Path(path_type=Path),
    default=None,
    help="start from these trained draft layers (a heads .safetensors file) instead of zero",
)
@click.option(
    "--root-conditioned",
    is_flag=True,
    help="draft layers that also read the root token (the target's sample they follow); beyond the paper",
)
@click.option(
    "--root-width",
    type=int,
    default=0,
    show_default=True,
    help="root-conditioned layers whose root input is an MLP of this width over the state and the root "
    "(0: one linear of the root)",
)
@click.option(
    "--path-width",
    type=int,
    default=0,
    show_default=True,
    help="a path input of this width drafts depths 2.. from the depth before and its drafted token "
    "(each tree branch its own candidates; needs --root-width); 0: none",
)
@click.option(
    "--path-only",
    is_flag=True,
    help="train the path input alone, the layers of --init-heads frozen with their draft vocabulary",
)
@click.option(
    "--draft-vocab",
    type=int,
    default=16384,
    show_default=True,
    help="the layers draft only this many of the training text's most frequent tokens (0: all of them)",
)
@click.option(
    "--state-cache",
    type=int,
    default=0,
    show_default=True,
    help="compute the base model's states of this many training sequences once (float16, in memory: "
    "N x seq-len x hidden x 2 bytes) and draw every batch from them; 0: a base forward per sequence",
)
@click.option(
    "--split-base",
    is_flag=True,
    help="under torchrun: split the frozen base over the ranks (tensor parallel, each rank a slice of "
    "every layer) for a model one device cannot hold; the draft layers still train data-parallel",
)
@click.option("--resume", is_flag=True, help="continue from OUT/checkpoint.pt")
@click.option("--force", is_flag=True, help="start over even if OUT holds a checkpoint")
@click.option(
    "--combined",
    type=click.Path(path_type=Path),
    default=None,
    help="also write base + heads in the released TokenSwift format here",
)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True)
def train_heads(
    model_dir,
    data,
    eval_data,
    field,
    out,
    steps,
    seq_len,
    batch,
    grad_accum,
    lr,
    warmup_steps,
    checkpoint_every,
    eval_every,
    seed,
    loss,
    teacher_min_p,
    teacher_penalty,
    teacher_window,
    init_heads,
    root_conditioned,
    root_width,
    path_width,
    path_only,
    draft_vocab,
    state_cache,
    split_base,
    resume,
    force,
    combined,
    dtype,
    device,
) -> None:
    """Train the 3 chained draft layers of a model with its base frozen. Under torchrun
    (`torchrun --nproc-per-node N -m tokenswift_trt train-heads ...`: gloo on CPUs, one GPU per rank
    with --device cuda) the ranks train data-parallel on the same global batch (--batch x --grad-accum
    sequences per step) and rank 0 writes the files; with --split-base they also hold the base
    between them."""
    from tokenswift_trt.training.ranks import join_ranks, leave_ranks
    from tokenswift_trt.training.run import TrainHeadsJob, start_training
    from tokenswift_trt.training.train_heads import TrainHeadsConfig, TrainingError

    from ..progress import progress_bar

    config = TrainHeadsConfig(
        steps=steps,
        seq_len=seq_len,
        batch=batch,
        grad_accum=grad_accum,
        lr=lr,
        warmup_steps=warmup_steps,
        checkpoint_every=checkpoint_every,
        eval_every=eval_every,
        seed=seed,
        loss=loss,
        teacher_min_p=teacher_min_p,
        teacher_penalty=teacher_penalty,
        teacher_window=teacher_window,
        root_conditioned=root_conditioned,
        root_width=root_width,
        path_width=path_width,
        path_only=path_only,
        draft_vocab=draft_vocab,
        state_cache=state_cache,
    )
    job = TrainHeadsJob(
        model_dir=model_dir,
        data=tuple(data),
        out=out,
        config=config,
        eval_data=tuple(eval_data),
        init_heads=init_heads,
        resume=resume,
        force=force,
        combined=combined,
        split_base=split_base,
        dtype=dtype,
        device=device,
        field=field,
        threads=_rank_threads(),
        command=given_command("tokenswift-trt train-heads"),
    )
    ranks = join_ranks(device)
    quiet = not ranks.main  # progress and messages from rank 0 only
    try:
        training = start_training(job, ranks)
        if ranks.main:
            for message in training.fallbacks:  # running without the CUDA kernel is always said
                click.echo(f"warning: {message}", err=True)
            over = f" over {ranks.size} ranks" if ranks.size > 1 else ""
            over += " (the base split between them)" if split_base and ranks.size > 1 else ""
            click.echo(
                f"training {training.draft_layer_count} draft layers on {training.train_ids.numel():,} "
                f"tokens{over}, from step {training.trainer.step}",
                err=True,
            )
        if config.state_cache:
            with progress_bar(total=config.state_cache, desc="base states", unit="seq", disable=quiet) as bar:
                training.cache_states(lambda done: bar.update(1))
        start = training.trainer.step
        with progress_bar(total=steps, initial=start, desc="train-heads", unit="step", disable=quiet) as bar:
            shown: dict[str, str] = {}

            def on_step(step: int, loss: float) -> None:
                shown["loss"] = f"{loss:.3f}"
                bar.set_postfix(shown, refresh=False)  # shown by the update's redraw
                bar.update(1)

            def on_evaluation(figures: dict) -> None:
                rates = figures["draft_coupled_acceptance"] or figures["draft_agrees_with_base"]
                shown["held-out"] = "/".join(f"{rate:.2f}" for rate in rates)

            training.train(on_step, on_evaluation)
        outcome = training.finish()
    except TrainingError as error:
        raise fail(error) from None
    finally:
        leave_ranks(ranks)
    if outcome is None:  # ranks other than 0 write and print nothing
        return
    accuracy, heads_path = outcome.accuracy, outcome.heads_path
    if outcome.combined is not None:
        click.echo(f"combined checkpoint (released TokenSwift format): {outcome.combined}")
    click.echo(f"heads file: {heads_path}")
    click.echo(
        f"held-out top-1 accuracy: base (+1) {accuracy.base:.3f}, "
        + ", ".join(f"layer {i} (+{i + 1}) {a:.3f}" for i, a in enumerate(accuracy.layers, start=1))
    )
    click.echo(
        "held-out agreement with the base model's top-1: "
        + ", ".join(f"layer {i} {a:.3f}" for i, a in enumerate(accuracy.agreement, start=1))
        + "".join(f", path depth {i} {a:.3f}" for i, a in enumerate(accuracy.path_agreement, start=2))
    )
    if accuracy.acceptance:
        teacher = config.teacher
        click.echo(
            f"held-out chance the first draft is the sample (min-p {teacher.min_p}, penalty "
            f"{teacher.penalty} over {teacher.penalty_window}): "
            + ", ".join(f"layer {i} {a:.3f}" for i, a in enumerate(accuracy.acceptance, start=1))
        )


def _rank_threads() -> int | None:
    """Under torchrun on CPUs, each rank's share of the node's cores (None outside a launcher)."""
    from tokenswift_trt.decode.threads import usable_cpus
    from tokenswift_trt.environment import launcher_assignment, launcher_local_size

    if launcher_assignment() is None:
        return None
    threads = max(1, usable_cpus() // launcher_local_size())
    import torch

    torch.set_num_threads(threads)  # the training's own matmuls, beside the kernels' setting
    return threads


@click.command("draft-vocab")
@click.option("--model", default=None, help="preset name (see `tokenswift-trt presets`)")
@click.option(
    "--model-dir", type=click.Path(path_type=Path), default=None, help="Hugging Face model directory"
)
@click.option(
    "--heads", type=click.Path(path_type=Path), default=None, help="heads file (default: the preset's)"
)
@click.option(
    "--data",
    "data",
    type=click.Path(path_type=Path),
    multiple=True,
    required=True,
    help=".txt/.jsonl file or folder whose tokens are counted (repeatable)",
)
@click.option("--size", type=int, default=16384, show_default=True, help="tokens in the draft vocabulary")
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="heads file to write (default: --heads)"
)
def draft_vocab(model, model_dir, heads, data, size, out) -> None:
    """Give a heads file a draft vocabulary: its layers then draft only the SIZE tokens most frequent
    in DATA, through those rows of the LM head (output unchanged; drafting reads less)."""
    from safetensors.torch import load_file, save_file

    from tokenswift_trt.decode.text import TextCodec, TokenizerError
    from tokenswift_trt.model.config import ConfigError, load_config
    from tokenswift_trt.model.draft_layers import HEADS_PREFIX, VOCAB_KEY
    from tokenswift_trt.training.data import read_texts
    from tokenswift_trt.training.train_heads import TrainingError, frequent_tokens

    model_dir, _, heads, _ = resolve_source(model, model_dir, None, heads)
    if heads is None:
        raise CliError("--heads FILE: which heads file gets the vocabulary")
    if not heads.is_file():
        raise CliError(f"heads file {heads} does not exist")
    if size <= 0:
        raise CliError(f"--size must be positive, got {size}")
    try:
        texts = read_texts(list(data))
        config = load_config(model_dir)
        codec = TextCodec.from_dir(model_dir)
    except (TrainingError, ConfigError, TokenizerError, OSError) as error:
        raise fail(error) from None
    import torch

    ids = torch.tensor([token for text in texts for token in codec.encode(text)], dtype=torch.long)
    vocab = frequent_tokens(ids, config.vocab_size, size)
    tensors = load_file(str(heads))
    key = HEADS_PREFIX + VOCAB_KEY
    tensors.pop(key, None)
    if vocab is not None:
        tensors[key] = vocab
    target = out or heads
    temporary = target.with_name(target.name + ".tmp")
    save_file(tensors, str(temporary))
    shutil.copymode(heads, temporary)  # the writer makes a private file; keep the heads file's mode
    temporary.replace(target)  # the old file stays whole until the new one is written
    if vocab is None:
        click.echo(
            f"{target}: no draft vocabulary (--size {size} covers the model's {config.vocab_size} tokens)"
        )
        return
    seen = torch.isin(ids, vocab).float().mean().item() if ids.numel() else 0.0
    click.echo(
        f"{target}: draft vocabulary of {vocab.numel():,} tokens from {ids.numel():,} counted; "
        f"it covers {seen:.1%} of them"
    )
