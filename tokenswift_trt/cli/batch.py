"""`batch`: many prompts decoded together (continuous batching), results to JSON Lines, resumable."""

from __future__ import annotations

import time
from pathlib import Path

import click

from .common import (
    CliError,
    PositiveGiB,
    fail,
    kernel_option,
    load_source,
    request_settings,
    sampling_options,
    source_options,
)


@click.command()
@source_options
@click.option(
    "--input",
    "input_path",
    type=click.Path(path_type=Path),
    required=True,
    help='requests: JSON Lines ({"id": ..., "prompt": ..., "max_new_tokens": ..., other settings}) or a '
    "text file of one prompt per line",
)
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    required=True,
    help="results, one JSON line per request as it finishes; requests already there are skipped",
)
@click.option("--max-new-tokens", type=int, default=None, help="tokens per request where a line gives none")
@click.option("--method", type=click.Choice(["tokenswift", "ar"]), default=None, help="[tokenswift]")
@click.option(
    "--max-batch", type=click.IntRange(1), default=8, show_default=True, help="requests decoded at once"
)
@click.option(
    "--journal-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="per-request journals [OUTPUT.journals/]: a killed run resumes each unfinished request token "
    "for token",
)
@click.option(
    "--memory-budget", type=PositiveGiB(), default=None, help="GiB all requests' caches may use together"
)
@kernel_option
@sampling_options
def batch(
    model,
    model_dir,
    engine_dir,
    heads,
    input_path,
    output,
    max_new_tokens,
    method,
    max_batch,
    journal_dir,
    memory_budget,
    kernels,
    **opts,
) -> None:
    """Generate after every prompt of a file, many requests decoded together in one model instance;
    each request's tokens are those of its own `generate` run. Rerun the same command after an
    interruption to continue where it stopped."""
    from tokenswift_trt.api import ApiError
    from tokenswift_trt.batch import append_line, done_ids, read_requests, run_batch

    from ..progress import progress_bar

    defaults = {name: value for name, value in request_settings(opts).items() if value is not None}
    if max_new_tokens is not None:
        defaults["max_new_tokens"] = max_new_tokens
    if method is not None:
        defaults["method"] = method
    try:
        items = read_requests(input_path, defaults)
        finished = done_ids(output)
    except ApiError as error:
        raise fail(error) from None
    except (ValueError, KeyError) as error:
        raise CliError(
            f"{output} is not a results file of this command ({error}): choose another --output"
        ) from None
    todo = [item for item in items if item.id not in finished]
    if finished:
        click.echo(f"note: {len(items) - len(todo)} of {len(items)} requests already in {output}", err=True)
    if not todo:
        return
    journals = journal_dir or output.with_name(output.name + ".journals")
    try:
        journals.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CliError(
            f"cannot create the journal folder {journals} ({error.strerror}): give --journal-dir"
        ) from None
    source = load_source(
        model, model_dir, engine_dir, heads, opts["dtype"], opts["device"], quiet=False, kernels=kernels
    )
    progress = progress_bar(total=len(items), initial=len(items) - len(todo), unit="req")
    started = time.perf_counter()
    tokens = 0

    def result(identifier: str, done) -> None:
        nonlocal tokens
        stats = done.stats
        tokens += len(done.token_ids)
        append_line(
            output,
            {
                "id": identifier,
                "status": "finished",
                "text": done.text,
                "token_ids": done.token_ids,
                "new_tokens": len(done.token_ids),
                "stop_reason": stats.stop_reason if stats else "finished",
                "acceptance_rate": stats.acceptance_rate if stats else 0.0,
                "tokens_per_s": stats.tokens_per_s if stats else 0.0,
            },
        )
        progress.update(1)

    def error(identifier: str, message: str) -> None:
        append_line(output, {"id": identifier, "status": "failed", "error": message})
        progress.update(1)

    def step(scheduler) -> None:
        progress.set_postfix(batch=len(scheduler.active), queued=len(scheduler.queue), refresh=False)

    memory = None if memory_budget is None else int(memory_budget * (1 << 30))
    try:
        scheduler = run_batch(source.model, todo, result, error, max_batch, memory, journals, on_step=step)
    except ApiError as failure:
        raise fail(failure) from None
    finally:
        progress.close()
    seconds = time.perf_counter() - started
    click.echo(
        f"{len(todo)} requests, {tokens} tokens in {seconds:.1f}s ({tokens / seconds:.1f} tok/s), "
        f"mean batch {scheduler.stats.mean_batch:.2f}; results in {output}",
        err=True,
    )
