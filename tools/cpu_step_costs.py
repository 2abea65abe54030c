"""What one forward costs on this CPU as a function of its new tokens T with each linear-layer path
(model/linear.py: PyTorch's own product, oneDNN prepacked, our tiled kernel), and what
attention alone costs per layer.

    .venv/bin/python -m tools.cpu_step_costs [--model-dir models/smollm2-135m] [--contexts 512,4096]
        [--tokens 1,2,4,8,16] [--paths mkl,onednn,tiled] [--no-attention]

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

from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.linear import Linear, tiled_kernels

PATHS = {"mkl": "nn.Linear (MKL)", "onednn": "oneDNN prepacked", "tiled": "tiled kernel"}


def load_with(model_dir: str, path: str):
    """The engine with every linear on one path (Q/K/V and gate/up fused except for MKL); attention
    and sampling as `load_engine` chose them, the same for all paths."""
    engine = load_engine(model_dir)
    if path == "oneDNN prepacked":
        engine.model.pack(KernelConfig(cpu_kernel="off"))  # packs in oneDNN's layout
    if path == "nn.Linear (MKL)":  # what a forward over more rows than the tiled kernel takes runs
        engine.model.cpu_decoder = None
        for module in engine.model.modules():
            if isinstance(module, Linear):
                module._packed = None
            if hasattr(module, "fused"):
                module.fused = None
    return engine


def forward_costs(
    model_dir: str, context: int, repeats: int, paths: list[str], tokens: list[int]
) -> dict[tuple[int, str], float]:
    """(T, path) -> median ms of forward + LM head over all T rows at `context` cached positions."""
    engines = {path: load_with(model_dir, path) for path in paths}
    config = next(iter(engines.values())).config
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, context + max(tokens))
    cache.keys[:, :, :context].normal_()
    cache.values[:, :, :context].normal_()
    cache.length = context
    times: dict[tuple[int, str], list[float]] = {}
    for count in tokens:
        ids = torch.randint(0, config.vocab_size, (count,))
        positions = torch.arange(context, context + count)
        for run in range(repeats + 3):
            for path, engine in engines.items():
                start = time.perf_counter()
                engine.model.logits(engine.model(ids, positions, cache).hidden)
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
    parser.add_argument("--tokens", default="1,2,4,8,16", help="new tokens T per forward")
    parser.add_argument("--paths", default="mkl,onednn,tiled", help=f"linear-layer paths: {', '.join(PATHS)}")
    parser.add_argument("--no-attention", action="store_true", help="skip the attention-only rows")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| context | linears | " + " | ".join(f"T={t} ms" for t in tokens) + " |")
    print("|---|---|" + "---|" * len(tokens))
    config = None
    with torch.inference_mode():
        chosen = [PATHS[name] for name in args.paths.split(",")]
        paths = [path for path in chosen if path != "tiled kernel" or tiled_kernels() is not None]
        for context in contexts:
            costs = forward_costs(args.model_dir, context, args.repeats, paths, tokens)
            for path in paths:
                row = " | ".join(f"{costs[(t, path)]:.2f}" for t in tokens)
                print(f"| {context:,} | {path} | {row} |")
        config = load_engine(args.model_dir).config
        for context in [] if args.no_attention else contexts:
            attention = attention_costs(config, context, args.repeats)
            print(
                f"attention, one layer, {context:,} keys: T=1 {attention[1]:.0f} µs, T=4 "
                f"{attention[4]:.0f} µs"
            )


if __name__ == "__main__":
    main()
