"""`train-data`: training text for the draft layers written by the target itself, under the sampling
that verification will draw from, with the batched decoder (resumable; sharded under torchrun)."""

from __future__ import annotations

from pathlib import Path

import click

from .batch import decode_requests
from .common import (
    CliError,
    PositiveGiB,
    dataset_option,
    fail,
    field_option,
    kernel_option,
    request_settings,
    resolve_source,
    sampling_options,
    source_options,
)

# The paper's sampling (TokenSwift, section 4: min-p 0.1, penalty θ 1.2 over W 1024), used where
# neither the flags nor the model's recorded settings give one.
PAPER_SAMPLING = {"temperature": 1.0, "min_p": 0.1, "penalty": 1.2, "penalty_window": 1024}


@click.command("train-data")
@source_options
@dataset_option("--prompts", "text the prompts are cut from")
@field_option
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    required=True,
    help="JSON Lines, one continuation per line as it finishes (the tokens in token_ids): train-heads --data "
    "reads it; a rerun continues it",
)
@click.option("--sequences", type=click.IntRange(1), default=256, show_default=True, help="continuations")
@click.option(
    "--prompt-tokens",
    type=click.IntRange(1),
    default=128,
    show_default=True,
    help="each prompt: this many tokens from a random place of the text",
)
@click.option(
    "--new-tokens", type=click.IntRange(1), default=1024, show_default=True, help="tokens per continuation"
)
@click.option(
    "--method",
    type=click.Choice(["tokenswift", "ar"]),
    default="tokenswift",
    show_default=True,
    help="both sample the same tokens; tokenswift is faster where the model has draft layers",
)
@click.option(
    "--max-batch", type=click.IntRange(1), default=8, show_default=True, help="requests decoded at once"
)
@click.option(
    "--memory-budget", type=PositiveGiB(), default=None, help="GiB all requests' caches may use together"
)
@kernel_option
@sampling_options
def train_data(
    model,
    model_dir,
    engine_dir,
    heads,
    prompts,
    field,
    output,
    sequences,
    prompt_tokens,
    new_tokens,
    method,
    max_batch,
    memory_budget,
    kernels,
    **opts,
) -> None:
    """Write training text for the draft layers: SEQUENCES continuations of NEW_TOKENS tokens that the
    model samples itself (the paper's min-p 0.1, θ 1.2 over 1,024 tokens unless the model's settings
    or the flags say otherwise) after prompts cut from PROMPTS. Draft layers trained on it (`train-heads
    --data OUTPUT`) learn the distribution verification accepts from. Rerun the same command after an
    interruption to continue. --seed (default 0) picks the prompts, and continuation i samples with
    SEED + i. Under torchrun (`torchrun --nproc-per-node N -m tokenswift_trt
    train-data ...`) each rank decodes its share and rank 0 gathers them."""
    from tokenswift_trt.batch import BatchItem
    from tokenswift_trt.decode.text import TextCodec, TokenizerError
    from tokenswift_trt.training.data import prompt_windows, read_records, record_ids
    from tokenswift_trt.training.errors import TrainingError

    seed = opts["seed"] or 0
    directory, engine, _, defaults = resolve_source(model, model_dir, engine_dir, heads)
    tokenizer_dir = directory or engine
    if tokenizer_dir is None:
        raise CliError("give the model: --model PRESET, --model-dir DIR or --engine DIR")
    try:
        codec = TextCodec.from_dir(tokenizer_dir)
        records = read_records(list(prompts), field)
        windows = prompt_windows(record_ids(records, codec.encode, []), sequences, prompt_tokens, seed)
    except (TrainingError, TokenizerError, OSError) as error:
        raise fail(error) from None
    given = {name: value for name, value in request_settings(opts).items() if value is not None}
    paper = {name: value for name, value in PAPER_SAMPLING.items() if name not in defaults}
    settings = {**paper, **given, "method": method, "max_new_tokens": new_tokens}
    items = [
        BatchItem(f"{index}", window, {**settings, "seed": seed + index})
        for index, window in enumerate(windows)
    ]
    source = (model, model_dir, engine_dir, heads, opts["dtype"], opts["device"], kernels)
    decode_requests(source, items, output, None, memory_budget, max_batch)
