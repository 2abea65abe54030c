"""`batch`: many prompts decoded together (continuous batching), results to JSON Lines, resumable;
under `torchrun`, the requests are shared among the ranks (one node or many)."""

from __future__ import annotations

import datetime
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
    interruption to continue where it stopped. Under torchrun (`torchrun --nproc-per-node N -m
    tokenswift_trt batch ...`, one node or many) each rank takes its share of the requests and rank 0
    gathers the results into OUTPUT."""
    from tokenswift_trt.api import ApiError
    from tokenswift_trt.batch import read_requests

    defaults = {name: value for name, value in request_settings(opts).items() if value is not None}
    if max_new_tokens is not None:
        defaults["max_new_tokens"] = max_new_tokens
    if method is not None:
        defaults["method"] = method
    try:
        items = read_requests(input_path, defaults)
    except ApiError as error:
        raise fail(error) from None
    source = (model, model_dir, engine_dir, heads, opts["dtype"], opts["device"], kernels)
    decode_requests(source, items, output, journal_dir, memory_budget, max_batch)


def decode_requests(source, items, output: Path, journal_dir, memory_budget, max_batch) -> None:
    """Decode `items` into the results file `output` as `batch` does: requests already there are
    skipped, unfinished ones resume from their journals, and under torchrun each rank takes its share
    and rank 0 gathers the results. `source`: (model, model_dir, engine_dir, heads, dtype, device,
    kernels) as the command's options give them."""
    from tokenswift_trt.batch import Shard, finished_ids
    from tokenswift_trt.decode.threads import usable_cpus
    from tokenswift_trt.environment import launcher_assignment, launcher_local_size

    model, model_dir, engine_dir, heads, dtype, device, kernels = source
    assigned = launcher_assignment()
    shard = Shard(assigned[0], assigned[1]) if assigned is not None else Shard()
    if assigned is not None and device == "cuda":  # one GPU per rank of a node
        device = f"cuda:{assigned[2]}"
    if shard.size > 1 and device == "cpu" and "threads" not in kernels:  # the node's ranks share its CPUs
        kernels = {**kernels, "threads": str(max(1, usable_cpus() // launcher_local_size()))}
    try:
        finished = finished_ids(output)
    except (ValueError, KeyError) as error:
        raise CliError(
            f"{output} is not a results file of this command ({error}): choose another --output"
        ) from None
    mine = shard.take(items)
    todo = [item for item in mine if item.id not in finished]
    if finished and shard.rank == 0:
        done = sum(item.id in finished for item in items)
        click.echo(f"note: {done} of {len(items)} requests already in {output}", err=True)
    if todo:
        journals = journal_dir or output.with_name(output.name + ".journals")
        try:
            journals.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CliError(
                f"cannot create the journal folder {journals} ({error.strerror}): give --journal-dir"
            ) from None
        loaded = load_source(
            model,
            model_dir,
            engine_dir,
            heads,
            dtype,
            device,
            quiet=False,
            kernels=kernels,
            data_parallel=True,
        )
        _run(loaded.model, shard, todo, len(mine), output, journals, memory_budget, max_batch)
    if shard.size > 1:
        _gather(shard, output, items)


def _run(model, shard, todo, share: int, output: Path, journals: Path, memory_budget, max_batch) -> None:
    """Decode this rank's `todo` requests (of its `share`), each result appended to its results file as
    the request ends."""
    from tokenswift_trt.api import ApiError
    from tokenswift_trt.batch import append_line, run_batch

    from ..progress import progress_bar

    results = shard.results(output)
    progress = progress_bar(
        total=share, initial=share - len(todo), unit="req", disable=True if shard.rank else None
    )
    started = time.perf_counter()
    tokens = 0

    def result(identifier: str, done) -> None:
        nonlocal tokens
        stats = done.stats
        tokens += len(done.token_ids)
        append_line(
            results,
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
        append_line(results, {"id": identifier, "status": "failed", "error": message})
        progress.update(1)

    def step(scheduler) -> None:
        progress.set_postfix(batch=len(scheduler.active), queued=len(scheduler.queue), refresh=False)

    memory = None if memory_budget is None else int(memory_budget * (1 << 30))
    try:
        scheduler = run_batch(model, todo, result, error, max_batch, memory, journals, on_step=step)
    except ApiError as failure:
        raise fail(failure) from None
    finally:
        progress.close()
    seconds = time.perf_counter() - started
    rank = f"rank {shard.rank} of {shard.size}: " if shard.size > 1 else ""
    click.echo(
        f"{rank}{len(todo)} requests, {tokens} tokens in {seconds:.1f}s ({tokens / seconds:.1f} tok/s), "
        f"mean batch {scheduler.stats.mean_batch:.2f}; results in {results}",
        err=True,
    )


GATHER_TIMEOUT = datetime.timedelta(days=7)  # ranks that finish first wait this long for the others


def _gather(shard, output: Path, items) -> None:
    """Once every rank is done (a gloo barrier over torchrun's rendezvous), rank 0 merges their result
    files into `output`. A rank that dies ends the run (torchrun stops the others); rerunning the
    command continues it."""
    import torch.distributed as dist

    from tokenswift_trt.batch import merge_shards

    dist.init_process_group("gloo", timeout=GATHER_TIMEOUT)
    try:
        dist.barrier()
        if shard.rank == 0:
            merged = merge_shards(output, items)
            click.echo(f"{merged} results of {shard.size} ranks merged into {output}", err=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
