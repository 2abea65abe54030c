"""What one forward costs on this CPU as a function of its new tokens T, with and without the
prepacked linear layers (runtime/cpu_linear.py), and what attention alone costs per layer.

    .venv/bin/python scripts/cpu_step_costs.py [--model-dir models/swift-tiny] [--contexts 2048,8192]

The K/V cache is filled with random values (the cost does not depend on them); each row is the
median of `--repeats` runs, packed and unpacked runs interleaved so that the machine's drift hits
both alike. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tokenswift_trt.runtime.cpu_linear import Linear
from tokenswift_trt.runtime.engine import load_engine
from tokenswift_trt.runtime.kv_cache import KVCache

TOKENS = (1, 2, 4, 8, 16)


def forward_costs(model_dir: str, context: int, repeats: int) -> dict[tuple[int, bool], float]:
    """(T, packed) -> median ms of forward + LM head over all T rows at `context` cached positions."""
    engine = load_engine(model_dir)
    model, config = engine.model, engine.config
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, context + max(TOKENS))
    cache.keys[:, :, :context].normal_()
    cache.values[:, :, :context].normal_()
    cache.length = context
    layers = [module for module in model.modules() if isinstance(module, Linear)]
    packs = [layer._packed for layer in layers]
    times: dict[tuple[int, bool], list[float]] = {}
    for count in TOKENS:
        tokens = torch.randint(0, config.vocab_size, (count,))
        positions = torch.arange(context, context + count)
        for run in range(repeats + 3):
            for packed in (False, True):
                for layer, pack in zip(layers, packs):
                    layer._packed = pack if packed else None
                start = time.perf_counter()
                model.logits(model(tokens, positions, cache).hidden)
                if run >= 3:  # warm-up
                    times.setdefault((count, packed), []).append((time.perf_counter() - start) * 1e3)
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
    parser.add_argument("--model-dir", default="models/swift-tiny")
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| context | linears | " + " | ".join(f"T={t} ms" for t in TOKENS) + " |")
    print("|---|---|" + "---|" * len(TOKENS))
    config = None
    with torch.inference_mode():
        for context in contexts:
            costs = forward_costs(args.model_dir, context, args.repeats)
            for packed in (False, True):
                name = "oneDNN prepacked" if packed else "nn.Linear (MKL)"
                print(
                    f"| {context:,} | {name} | "
                    + " | ".join(f"{costs[(t, packed)]:.2f}" for t in TOKENS)
                    + " |"
                )
        config = load_engine(args.model_dir).config
        for context in contexts:
            attention = attention_costs(config, context, args.repeats)
            print(
                f"attention, one layer, {context:,} keys: T=1 {attention[1]:.0f} µs, T=4 "
                f"{attention[4]:.0f} µs"
            )


if __name__ == "__main__":
    main()
