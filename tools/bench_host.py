"""Host time per TokenSwift iteration: decode time outside model calls, and the tensor operations the
host dispatches (each a kernel launch on a GPU), or with --device-loop the device loop's own host time
and its wait for each iteration's report. The GPU check's `host` and `loop` stages run it (docs/gpu.md).

    .venv/bin/python -m tools.bench_host --model-dir models/swift-tiny \
        --prompt-file models/swift-tiny/prompt.txt --max-new-tokens 1024 --tree 1,3,3,3 --ignore-eos

The options are `tokenswift-trt generate`'s source and sampling options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import click
from torch.utils._python_dispatch import TorchDispatchMode

from tokenswift_trt.bench.host import TimedModel, measure_host_overhead
from tokenswift_trt.cli.common import (
    CliError,
    early_defaults,
    fail,
    generation_config,
    load_source,
    read_prompt,
    sampling_options,
    source_options,
)
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.engine import Engine

# operations that launch nothing: they wrap, detach or alias tensors
NO_KERNEL = frozenset({"lift_fresh", "detach", "detach_", "alias"})


class HostOpCounter(TorchDispatchMode):
    """Counts tensor operations dispatched while `model` is not inside a model call and `counting`
    is set; views and the NO_KERNEL operations are not counted."""

    def __init__(self, model: TimedModel) -> None:
        super().__init__()
        self.model = model
        self.counting = False
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            self.counting
            and self.model.depth == 0
            and not func.is_view
            and func.overloadpacket.__name__ not in NO_KERNEL
        ):
            self.ops += 1
        return func(*args, **(kwargs or {}))


def count_host_ops(engine: Engine, prompt: Sequence[int], config: GenerationConfig) -> int:
    """Tensor operations dispatched outside model calls from the end of the first iteration to the end
    of the last (as `measure_host_overhead` times them; give it that run's seed for the same work)."""
    timed = TimedModel(engine.model, engine.device)
    counter = HostOpCounter(timed)

    def start_counting(stats) -> None:
        counter.counting = True  # after the first iteration, as for the times

    with counter:
        generate(
            replace(engine, model=timed),
            prompt,
            replace(config, method="tokenswift"),
            observer=start_counting,
        )
    return counter.ops


@dataclass
class DeviceLoopHostTime:
    """The device loop's host side: its own time per iteration (queue the captured graph and the
    report's copy) and its wait for the report of the iteration before."""

    tree: str
    ngram_topk: int
    iterations: int
    tokens: int
    mean_accept_length: float
    graph_replays: int
    host_ms_per_iteration: float
    wait_ms_per_iteration: float
    tokens_per_s: float


def device_loop_host_time(
    engine: Engine, prompt: Sequence[int], config: GenerationConfig
) -> DeviceLoopHostTime:
    """Generate with `config` (its `device_loop` on) and read the host's and the wait's time per
    iteration from the generation's phases."""
    tokens, stats = generate(engine, prompt, config)
    per_iteration = {name: seconds / stats.iterations * 1e3 for name, seconds in stats.phase_s.items()}
    return DeviceLoopHostTime(
        str(config.tree),
        config.ngram_topk,
        stats.iterations,
        len(tokens),
        stats.mean_accept_length,
        stats.graph_replays,
        per_iteration.get("host", 0.0),
        per_iteration.get("wait", 0.0),
        stats.tokens_per_s,
    )


@click.command("bench_host")
@source_options
@click.option(
    "--prompt-file", type=click.Path(path_type=Path), required=True, help="text the prompt is cut from"
)
@click.option("--prefix-len", type=int, default=512, show_default=True, help="prompt tokens")
@click.option("--max-new-tokens", type=int, default=1024, show_default=True)
@sampling_options
def main(model, model_dir, engine_dir, heads, prompt_file, prefix_len, max_new_tokens, **opts) -> None:
    """Host time per TokenSwift iteration: decode time outside model calls."""
    if prefix_len < 1 or max_new_tokens < 2:
        raise CliError("--prefix-len must be >= 1 and --max-new-tokens >= 2")
    if opts["seed"] is None:
        opts["seed"] = 0
    defaults = early_defaults(model, model_dir, engine_dir, heads)
    config = generation_config(max_new_tokens, "tokenswift", opts, defaults)  # bad values: refused now
    text = read_prompt(None, prompt_file)
    source = load_source(model, model_dir, engine_dir, heads, opts["dtype"], opts["device"], quiet=False)
    prompt = source.codec.encode(text)[:prefix_len]
    try:
        if config.device_loop:
            loop = device_loop_host_time(source.engine, prompt, config)
        else:
            result = measure_host_overhead(source.engine, prompt, config)
            host_ops = count_host_ops(source.engine, prompt, replace(config, seed=result.seed))
    except ValueError as error:  # GenerationError included
        raise fail(error) from None
    if config.device_loop:
        click.echo(
            f"device loop, tree {loop.tree}, k={loop.ngram_topk}, {loop.iterations} iterations, "
            f"{loop.tokens} tokens, {loop.mean_accept_length:.2f} tokens/iteration, "
            f"{loop.graph_replays} graph replays"
        )
        click.echo(
            f"host ms/iteration: {loop.host_ms_per_iteration:.3f} (queue the iteration and its report)  "
            f"wait ms/iteration: {loop.wait_ms_per_iteration:.3f} (for the report one iteration late)"
        )
        click.echo(f"{loop.tokens_per_s:.1f} tokens/s")
        return
    click.echo(
        f"tree {config.tree}, k={config.ngram_topk}, {result.iterations} iterations, "
        f"{result.new_tokens} tokens"
    )
    click.echo(
        f"host ms/iteration: {result.host_ms_per_iteration:.3f}  model ms/iteration: "
        f"{result.model_ms_per_iteration:.3f}"
    )
    click.echo(
        f"host tensor ops/iteration: {host_ops / result.iterations:.1f} (outside model calls, views "
        "excluded: each is a kernel launch on a GPU)"
    )
    phases = ", ".join(
        f"{name} {seconds / result.iterations * 1e3:.3f}" for name, seconds in result.phase_s.items()
    )
    click.echo(f"phases (ms/iteration, model calls included): {phases}")


if __name__ == "__main__":
    main()
