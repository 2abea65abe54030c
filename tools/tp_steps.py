"""What the all-reduces cost in one step of a tensor-parallel model (docs/deploy.md, "Tensor parallelism").

    .venv/bin/python -m tools.tp_steps --model swift-tiny --tp 2 --contexts 1024 --tree-sizes 1,16 \
        --out runs/tp-steps

Every rank builds its slice of a model's shape with random weights (model/tensor_parallel.py: the
per-rank shape, row-parallel o_proj and down_proj) and times, per context L and new tokens T:
- the whole step (T tokens after L cached positions, the rank's PyTorch layers and their all-reduces),
- the step's collectives alone: 2 x layers all-reduces of [T, hidden] in the model's dtype,
- the LM head on the step's T rows as decoding applies it to sample (`LlamaModel.target_logits`,
  greedy): replicated, every rank's whole head (on a CPU the float16-screened one where it applies);
  split over the vocabulary (`--tp-head vocab`), the rank's rows and the all-gather of [T, V] logits,
each the median of `--step-repeats` runs, every rank timing the same runs in step (a barrier before
each). Without torchrun the command starts ranks 1..N-1 itself (`cli/tp_launch.py`); rank 0 writes
tp_steps.csv and tp_steps.json under --out and prints a line per (L, T).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch
import torch.distributed as dist

from tokenswift_trt.bench.report import write_csv
from tokenswift_trt.bench.step_bench import check_cuda
from tokenswift_trt.bench.steps import device_description, fill_random
from tokenswift_trt.builder.build import BuildRequest, resolve
from tokenswift_trt.cli.common import CliError, fail, int_list, kernel_option, report_out_option
from tokenswift_trt.cli.tp_launch import start_ranks, tp_options
from tokenswift_trt.environment import machine_meta
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.config import ModelConfig, config_from_dict, load_config
from tokenswift_trt.model.decoder import LlamaModel
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig
from tokenswift_trt.model.tensor_parallel import (
    TensorParallel,
    make_row_parallel,
    make_vocab_parallel_head,
    shard_config,
)


@dataclass(frozen=True)
class TpStepCost:
    context: int  # cached positions L
    tokens: int  # new tokens T
    step_ms: float  # median of the whole step on rank 0 (the layers, without the LM head)
    all_reduce_ms: float  # median of the step's all-reduces alone
    all_reduces: int  # per step: 2 per layer
    head_ms: float = 0.0  # median of the LM head on the T rows (its all-gather under head="vocab")

    @property
    def all_reduce_share(self) -> float:
        return self.all_reduce_ms / self.step_ms if self.step_ms else 0.0


def model_config(model: str) -> ModelConfig:
    """The config of a preset or a model directory (what the ranks split), no weights read."""
    preset, directory = resolve(BuildRequest(model=model, out=Path("."), random_weights=True))
    return config_from_dict(preset.config) if preset is not None else load_config(directory)


def random_rank_model(
    config: ModelConfig,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
    kernels: KernelConfig = KernelConfig(),
    seed: int = 0,
) -> LlamaModel:
    """This rank's slice of `config`'s shape with random weights (norms 1, the rest N(0, 0.02)), its
    products packed as `load_engine(tp=...)` packs them."""
    with torch.device("meta"):
        model = LlamaModel(shard_config(config, tp.size), device="meta")
        make_row_parallel(model, tp)
        make_vocab_parallel_head(model, tp)
    model.to_empty(device=device)
    model.to(dtype)
    model.tie_weights()
    model.rotary.to(device)
    fill_random(model.named_parameters(), device, seed + tp.rank)
    model.pack(kernels)
    model.cpu_decoder = None  # as under load_engine(tp=...): the all-reduces sit between the layers
    return model.eval()


def _median_ms(run: Callable[[], object], repeats: int, group: object) -> float:
    """Median wall time of `run()` over `repeats` runs, the ranks starting each together."""
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        dist.barrier(group=group)
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1e3


@torch.inference_mode()
def measure_tp_steps(
    model: LlamaModel,
    tp: TensorParallel,
    contexts: Sequence[int],
    sizes: Sequence[int],
    repeats: int,
) -> list[TpStepCost]:
    """The step and all-reduce costs at every (context, tokens) pair."""
    c, device = model.config, model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    costs = []
    for context in contexts:
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, context + max(sizes), dtype, device)
        for size in sizes:
            tokens = torch.randint(0, c.vocab_size, (size,), device=device)
            positions = torch.arange(context, context + size, device=device)

            buffer = torch.zeros(size, c.hidden_size, dtype=dtype, device=device)
            step = functools.partial(_step, model, tokens, positions, cache, context)
            reduces = functools.partial(_reduces, tp, buffer, 2 * c.num_layers)
            hidden = torch.randn(size, c.hidden_size, dtype=dtype, device=device)  # [T, hidden]
            head = functools.partial(model.target_logits, hidden, SamplingConfig(temperature=0.0), tokens)
            costs.append(
                TpStepCost(
                    context,
                    size,
                    round(_median_ms(step, repeats, tp.group), 4),
                    round(_median_ms(reduces, repeats, tp.group), 4),
                    2 * c.num_layers,
                    round(_median_ms(head, repeats, tp.group), 4),
                )
            )
    return costs


def _step(
    model: LlamaModel, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, context: int
) -> None:
    cache.length, cache.pending = context, 0  # the same L every run
    model(tokens, positions, cache)


def _reduces(tp: TensorParallel, buffer: torch.Tensor, count: int) -> None:
    for _ in range(count):
        tp.all_reduce(buffer)


def write_tp_report(costs: Sequence[TpStepCost], out_dir: Path, meta: dict) -> list[Path]:
    """tp_steps.csv and tp_steps.json (rows and the run's description)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{**asdict(cost), "all_reduce_share": round(cost.all_reduce_share, 4)} for cost in costs]
    csv_path, json_path = write_csv(out_dir / "tp_steps.csv", rows), out_dir / "tp_steps.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return [csv_path, json_path]


@click.command("tp_steps")
@click.option(
    "--model", required=True, help="preset name or model directory whose shape is timed (random weights)"
)
@click.option("--contexts", default="1024", show_default=True, help="cached positions L")
@click.option("--tree-sizes", default="1,16", show_default=True, help="new tokens T per step")
@click.option("--step-repeats", type=int, default=20, show_default=True, help="timed runs per step (median)")
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True
)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--tp-head",
    type=click.Choice(["replicated", "vocab"]),
    default=None,
    help="the LM head replicated on every rank, or split over the vocabulary with an all-gather of the "
    "logits [vocab on GPUs, replicated on a CPU]",
)
@report_out_option("runs/tp-steps")
@kernel_option
@tp_options
def main(model, contexts, tree_sizes, step_repeats, dtype, device, tp_head, out, kernels, tp, tp_timeout):
    """Time one rank's slice of a tensor-parallel step, its all-reduces and its LM head on --tp ranks."""
    try:
        check_cuda(device)
        context_list, sizes = int_list(contexts, "--contexts"), int_list(tree_sizes, "--tree-sizes")
        config = model_config(model)
        asked = {"--model": model, "--dtype": dtype, "--kernel": sorted(kernels.items())}
        asked["--tp-head"] = tp_head  # what every rank must agree on before timing
        ranks = start_ranks(tp, tp_timeout, config, asked, device)
    except (ValueError, RuntimeError) as error:
        raise fail(error) from None
    click.get_current_context().call_on_close(ranks.close)
    group = dataclasses.replace(ranks.tp, head=tp_head or ranks.tp.head)
    place = torch.device(ranks.device)
    settings = KernelConfig().updated(kernels)
    rank_model = random_rank_model(config, group, getattr(torch, dtype), place, settings)
    try:
        costs = measure_tp_steps(rank_model, group, context_list, sizes, step_repeats)
    except RuntimeError as error:
        raise CliError(f"a tensor-parallel rank stopped or timed out: {fail(error).message}") from None
    if not ranks.leader:
        return
    meta = {
        "command": f"python -m tools.tp_steps --model {model} --tp {tp} --tp-head {group.head} "
        f"(contexts {context_list}, tree sizes {sizes}, {step_repeats} repeats)",
        "model": model,
        "tp": tp,
        "tp_head": group.head,
        "screened_head": rank_model.screened_head is not None,
        "random_weights": True,
        "dtype": dtype,
        "device": device_description(place),
        "backend": "nccl" if place.type == "cuda" else "gloo",
        "load_average": round(os.getloadavg()[0], 2),
        **machine_meta(),
    }
    for path in write_tp_report(costs, out, meta):
        click.echo(f"wrote {path}", err=True)
    for cost in costs:
        click.echo(
            f"L={cost.context} T={cost.tokens}: step {cost.step_ms:.3f} ms, its {cost.all_reduces} "
            f"all-reduces {cost.all_reduce_ms:.3f} ms ({cost.all_reduce_share:.0%}); LM head "
            f"({group.head}) {cost.head_ms:.3f} ms"
        )


if __name__ == "__main__":
    main()
