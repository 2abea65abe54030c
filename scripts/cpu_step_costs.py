"""What one forward costs on this CPU as a function of its new tokens T with each linear-layer path
(backends/cpu_linear.py: PyTorch's own product, oneDNN prepacked, our tiled kernel), and what
attention alone costs per layer.

    .venv/bin/python scripts/cpu_step_costs.py [--model-dir models/smollm2-135m] [--contexts 512,4096]

The K/V cache is filled with random values (the cost does not depend on them); each row is the
median of `--repeats` runs, the three paths' runs interleaved so that the machine's drift hits all
alike. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tokenswift_trt.backends.cpu_linear import Linear, tiled_kernels
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.kv_cache import KVCache

TOKENS = (1, 2, 4, 8, 16)
PATHS = ("nn.Linear (MKL)", "oneDNN prepacked", "tiled kernel")


def load_with(model_dir: str, path: str):
    """The engine with every linear on one path (Q/K/V and gate/up fused except for MKL); attention
    and sampling as `load_engine` chose them, the same for all paths."""
    engine = load_engine(model_dir)
    if path == "oneDNN prepacked":
        engine.model.pack(KernelConfig(cpu_kernel="off"))  # packs in oneDNN's layout
    if path == "nn.Linear (MKL)":
        for module in engine.model.modules():
            if isinstance(module, Linear):
                module._packed = None
            if hasattr(module, "fused"):
                module.fused = None
    return engine


def forward_costs(
    model_dir: str, context: int, repeats: int, paths: list[str]
) -> dict[tuple[int, str], float]:
    """(T, path) -> median ms of forward + LM head over all T rows at `context` cached positions."""
    engines = {path: load_with(model_dir, path) for path in paths}
    config = next(iter(engines.values())).config
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, context + max(TOKENS))
    cache.keys[:, :, :context].normal_()
    cache.values[:, :, :context].normal_()
    cache.length = context
    times: dict[tuple[int, str], list[float]] = {}
    for count in TOKENS:
        tokens = torch.randint(0, config.vocab_size, (count,))
        positions = torch.arange(context, context + count)
        for run in range(repeats + 3):
            for path, engine in engines.items():
                start = time.perf_counter()
                engine.model.logits(engine.model(tokens, positions, cache).hidden)
                if run >= 3:  # warm-up
                    times.setdefault((count, path), []).append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def attention_costs(config, context: int, repeats: int) -> dict[int, float]:
    """T -> median µs of one layer's SDPA over `context` keys, GQA folded as the model does."""
    group = config.num_heads // config.num_kv_heads
    keys = torch.randn(config.num_kv_heads, context, config.head_dim)
    values = torch.randn_like(keys)
    costs = {}
    for count in (1, 4):
        query = torch.randn(config.num_kv_heads, group * count, config.head_dim)
        bias = torch.zeros(group * count, context)
        samples = []
        for run in range(repeats + 3):
            start = time.perf_counter()
            F.scaled_dot_product_attention(query[None], keys[None], values[None], attn_mask=bias)
            if run >= 3:
                samples.append((time.perf_counter() - start) * 1e6)
        costs[count] = statistics.median(samples)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="models/smollm2-135m")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| context | linears | " + " | ".join(f"T={t} ms" for t in TOKENS) + " |")
    print("|---|---|" + "---|" * len(TOKENS))
    config = None
    with torch.inference_mode():
        paths = [path for path in PATHS if path != "tiled kernel" or tiled_kernels() is not None]
        for context in contexts:
            costs = forward_costs(args.model_dir, context, args.repeats, paths)
            for path in paths:
                row = " | ".join(f"{costs[(t, path)]:.2f}" for t in TOKENS)
                print(f"| {context:,} | {path} | {row} |")
        config = load_engine(args.model_dir).config
        for context in contexts:
            attention = attention_costs(config, context, args.repeats)
            print(
                f"attention, one layer, {context:,} keys: T=1 {attention[1]:.0f} µs, T=4 "
                f"{attention[4]:.0f} µs"
            )


if __name__ == "__main__":
    main()
