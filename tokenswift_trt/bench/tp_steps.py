"""`bench-steps --tp N`: what the all-reduces cost in one step of a tensor-parallel model.

Every rank builds its slice of a model's shape with random weights (model/tensor_parallel.py: the
per-rank shape, row-parallel o_proj and down_proj) and times, per context L and new tokens T:
- the whole step (T tokens after L cached positions, the rank's PyTorch layers and their all-reduces),
- the step's collectives alone: 2 x layers all-reduces of [T, hidden] in the model's dtype,
- the LM head on the step's T rows as decoding applies it to sample (`LlamaModel.target_logits`,
  greedy): replicated, every rank's whole head (on a CPU the float16-screened one where it applies);
  split over the vocabulary (`head="vocab"`), the rank's rows and the all-gather of [T, V] logits,
each the median of `repeats` runs, every rank timing the same runs in step (a barrier before each).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.config import ModelConfig
from tokenswift_trt.model.decoder import LlamaModel
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig
from tokenswift_trt.model.tensor_parallel import (
    TensorParallel,
    make_row_parallel,
    make_vocab_parallel_head,
    shard_config,
)

from .report import write_csv
from .steps import fill_random


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


def _median_ms(run, repeats: int, group) -> float:
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
