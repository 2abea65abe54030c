"""`build` (engine directories), `presets` and `random-model`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .common import DTYPES, CliError, fail, kernel_option


@click.command()
@click.option(
    "--model",
    required=True,
    help="preset name (see `presets`), a Hugging Face model directory or a .gguf file",
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="engine directory to write")
@click.option(
    "--checkpoint",
    type=click.Path(path_type=Path),
    default=None,
    help="checkpoint dir (default: $TOKENSWIFT_HOME/<preset>)",
)
@click.option(
    "--heads",
    type=click.Path(path_type=Path),
    default=None,
    help="draft layers: heads file or released checkpoint",
)
@click.option(
    "--backend", type=click.Choice(["torch", "onnx", "tensorrt"]), default="torch", show_default=True
)
@click.option(
    "--dtype", type=click.Choice(DTYPES), default=None, help="default: the preset's (bfloat16), else float32"
)
@click.option("--random-weights", is_flag=True, help="correctly shaped random weights (performance work)")
@click.option(
    "--max-length",
    type=click.IntRange(2),
    default=None,
    help="maximum sequence length (default: the model's)",
)
@click.option("--force", is_flag=True, help="replace an existing engine directory")
@click.option(
    "--no-drafts",
    is_flag=True,
    help="build a checkpoint that has no draft layers anyway (TokenSwift then runs at AR speed)",
)
@click.option(
    "--tp",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="split the weights into one file per tensor-parallel rank (each rank's slices only); the engine "
    "then loads with --tp N only (torch backend)",
)
@kernel_option
def build(
    model, out, checkpoint, heads, backend, dtype, random_weights, max_length, force, no_drafts, tp, kernels
) -> None:
    """Build an engine directory from a preset, checkpoint or GGUF file (torch, onnx or tensorrt backend);
    its manifest records the kernel settings, the engine's defaults."""
    from tokenswift_trt.builder.build import BuildError, BuildRequest, build_engine
    from tokenswift_trt.kernels.config import KernelConfig

    from ..progress import progress_bar

    bars: dict[str, Any] = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = progress_bar(total=total, desc=stage, leave=False)
        bar.update(done - bar.n)  # redraws as often as the bar allows (a log: every few seconds)
        if done >= total:
            bar.close()

    request = BuildRequest(
        model=model,
        out=out,
        checkpoint=checkpoint,
        heads=heads,
        backend=backend,
        dtype=dtype,
        random_weights=random_weights,
        force=force,
        max_sequence_length=max_length,
        kernels=KernelConfig().updated(kernels),
        tp=tp,
        no_drafts=no_drafts,
    )
    try:
        path = build_engine(request, progress, log=lambda message: click.echo(message, err=True))
    except (BuildError, RuntimeError, OSError) as error:
        raise fail(error) from None
    finally:
        for bar in bars.values():
            bar.close()
    click.echo(f"engine: {path}")


@click.command("presets")
def presets() -> None:
    """List the model presets with their shapes and the settings they override (the paper's)."""
    from tokenswift_trt.builder.presets import PRESETS

    for preset in PRESETS.values():
        click.echo(
            f"{preset.name:22s} {preset.parameter_count() / 1e9:6.2f}B  {preset.dtype:9s} {preset.hf_name}  "
            f"settings: {preset.defaults}"
        )


@click.command("random-model")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="directory to write")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="overwrite an existing directory")
def random_model(out: Path, seed: int, force: bool) -> None:
    """Write a tiny random-weight Llama directory (with a byte-level tokenizer) for demos and tests."""
    from tokenswift_trt.builder.random_model import write_random_model

    if (out / "config.json").exists() and not force:
        raise CliError(f"{out} already holds a model: pass --force to overwrite")
    write_random_model(out, seed=seed)
    click.echo(f"wrote a random-weight tiny Llama to {out}")
