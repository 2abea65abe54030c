"""`bench`: AR vs TokenSwift in whole generations (`bench-steps` is in bench_steps.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .common import (
    CliError,
    early_defaults,
    fail,
    generation_config,
    int_list,
    kernel_option,
    load_source,
    read_prompt,
    report_out_option,
    sampling_options,
    source_options,
    unequal_tokens_note,
)
from .tp_launch import tp_options


@click.command()
@source_options
@click.option(
    "--prompt-file", type=click.Path(path_type=Path), default=None, help="text to cut prompts from [required]"
)
@click.option(
    "--random-weights",
    is_flag=True,
    help="time --model's shape (a preset such as llama3.1-8b) with random weights built on the device: "
    "no checkpoint or text, random prompt ids, a static --tree; reports measured ms per AR token and "
    "per TokenSwift iteration and the speedup they give at --accept-length",
)
@click.option(
    "--accept-length",
    type=float,
    default=None,
    help="with --random-weights: tokens per iteration assumed for the modeled speedup, at most what the "
    "tree can commit (its depth + 1) [the tree's depth + 1: every draft accepted]",
)
@click.option("--gen-len", default="2048,8192", show_default=True, help="generation lengths")
@click.option("--prefix-len", default="512", show_default=True, help="prompt lengths in tokens")
@click.option("--prompts", type=int, default=1, show_default=True, help="prompts per prefix length")
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option(
    "--interleave",
    type=int,
    default=256,
    show_default=True,
    help="new tokens each method decodes per turn, each timed on its own clock (0: one after another)",
)
@click.option(
    "--window",
    type=int,
    default=256,
    show_default=True,
    help="output positions per window of the figures by position (bench_windows.csv)",
)
@click.option(
    "--no-extras",
    is_flag=True,
    help="AR and TokenSwift only: skip the penalty-off and paper-tree runs (half the time)",
)
@click.option(
    "--compare-adaptation",
    is_flag=True,
    help="also TokenSwift with draft layers adapted online (--adapt-drafts) beside the engine's own: "
    "adapted_* columns and the variant column of bench_windows.csv",
)
@report_out_option("runs/bench")
@kernel_option
@tp_options
@sampling_options
def bench(
    model,
    model_dir,
    engine_dir,
    heads,
    prompt_file,
    random_weights,
    accept_length,
    gen_len,
    prefix_len,
    prompts,
    repeats,
    interleave,
    window,
    no_extras,
    compare_adaptation,
    out,
    kernels,
    tp,
    tp_timeout,
    **opts,
) -> None:
    """AR vs TokenSwift: tokens/s, speedup, α, β and Distinct-n per generation length; CSV + JSON. With
    --tp N every run is split over N tensor-parallel ranks; rank 0 writes the report."""
    from tokenswift_trt.bench.compare import (
        BenchJob,
        check_counts,
        check_random_weights,
        random_weights_engine,
        run_comparison,
        write_comparison,
    )
    from tokenswift_trt.bench.run import BenchSpec

    from ..progress import progress_bar

    gen_lens, prefix_lens = int_list(gen_len, "--gen-len"), int_list(prefix_len, "--prefix-len")
    try:
        check_counts(prompts, repeats, interleave, window)
    except ValueError as error:
        raise fail(error) from None
    if opts["seed"] is None:
        opts["seed"] = 0
    if random_weights and tp > 1:
        raise CliError(
            f"--random-weights times one process: drop --tp {tp} (the repository's `python -m "
            f"tools.tp_steps --tp {tp}` times a split step)"
        )
    ranks = None
    if random_weights:
        try:
            defaults = check_random_weights(
                model, any((model_dir, engine_dir, heads, prompt_file)), opts["tree"], accept_length
            )
            # bad settings fail before weights are built
            config = generation_config(max(gen_lens), "tokenswift", opts, defaults)
            engine, text_ids = random_weights_engine(
                model, opts["dtype"], opts["device"], kernels, prefix_lens, prompts
            )
        except ValueError as error:
            raise fail(error) from None
        source_name = f"{model} (random weights)"
    else:
        if prompt_file is None:
            raise CliError("--prompt-file is required (or --random-weights with --model)")
        if accept_length is not None:
            raise CliError(
                "--accept-length models a speedup from measured times: give it with --random-weights"
            )
        defaults = early_defaults(model, model_dir, engine_dir, heads)
        config = generation_config(max(gen_lens), "tokenswift", opts, defaults)  # bad values: refused now
        text = read_prompt(None, prompt_file)
        source = load_source(
            model,
            model_dir,
            engine_dir,
            heads,
            opts["dtype"],
            opts["device"],
            quiet=False,
            kernels=kernels,
            tp=tp,
            tp_timeout=tp_timeout,
        )
        assert source.defaults == defaults, "the config was built from the defaults the source loads with"
        engine, ranks = source.engine, source.ranks
        text_ids = source.codec.encode(text)
        source_name = str(source.model_dir or source.engine_dir)
    if ranks is not None:  # tensor parallel: rank 0's seed and plan, the least memory any rank has
        config = ranks.with_memory(ranks.agree(config))

    def progress(label: str, total: int):
        bar = progress_bar(total=total, desc=label, unit="tok", leave=False)

        def update(ids: list[int]) -> None:
            if ranks is not None:
                ranks.check_tokens(ids)  # every rank committed the same tokens
            bar.update(len(ids))
            if bar.n >= total:
                bar.close()

        return update

    spec = BenchSpec(
        gen_lens, prefix_lens, prompts, repeats, config, interleave, not no_extras, window, compare_adaptation
    )
    try:
        rows = run_comparison(engine, text_ids, spec, progress)
    except ValueError as error:
        raise fail(error) from None
    except RuntimeError as error:  # tensor parallel: a rank stopped or timed out in a collective
        if ranks is None:
            raise
        raise CliError(f"the tensor-parallel run stopped: {fail(error).message}") from None
    if ranks is not None and not ranks.leader:
        return  # rank 0 writes the report
    job = BenchJob(
        spec,
        out,
        command="tokenswift-trt bench " + " ".join(sys.argv[2:]),
        source=source_name,
        device=opts["device"],
        random_weights_model=model if random_weights else None,
        accept_length=accept_length,
        tp=tp,
    )
    outcome = write_comparison(engine, rows, job)
    click.echo(" | ".join(outcome.columns))
    for row in outcome.rows:
        click.echo(" | ".join(str(row[c]) for c in outcome.columns))
    long_run = outcome.long_run
    if long_run is not None:
        click.echo(
            f"modeled generation of {long_run['tokens']} tokens from a {long_run['from_context']}-token "
            f"prompt (linear between the measured prompt lengths, {outcome.meta['accept_length']} tokens "
            f"per iteration): AR {long_run['ar_s']} s, TokenSwift {long_run['tokenswift_s']} s, "
            f"{long_run['modeled_speedup']}x"
        )
    if not outcome.tokens_equal_ar:
        click.echo(unequal_tokens_note(opts["device"], str(engine.dtype)), err=True)
    click.echo("wrote " + ", ".join(str(p) for p in outcome.written))
