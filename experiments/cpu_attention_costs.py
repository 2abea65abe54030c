"""What a verify forward of T new tokens costs on this CPU with attention through torch's SDPA and
through the compiled CPU tree-attention kernel (plugins_cuda/cpu/tree_attention_cpu.cpp), whole
decoder, swift-tiny's shape, at several cached contexts.

    .venv/bin/python experiments/cpu_attention_costs.py [--model-dir models/swift-tiny] [--contexts
    1024,4096,8192,16384]

The K/V cache is filled with random values (the cost does not depend on them); the T new tokens
form a causal chain. Every (T, attention) pair runs once per round, rounds interleaved so that the
machine's drift hits all alike; each cell is the median over `--repeats` rounds, and the ratio in
brackets is against T = 1 with the same attention. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.kv_cache import KVCache

TOKENS = (1, 2, 3, 4, 6, 8)
ATTENTION = {"SDPA": "sdpa", "CPU kernel": "cpu_tree_attention"}


def costs(model, config, context: int, repeats: int) -> dict[tuple[str, int], float]:
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, context + max(TOKENS))
    cache.keys[:, :, :context].normal_()
    cache.values[:, :, :context].normal_()
    cache.length = context
    samples: dict[tuple[str, int], list[float]] = {}
    for run in range(repeats + 3):
        for count in TOKENS:
            tokens = torch.randint(0, config.vocab_size, (count,))
            positions = torch.arange(context, context + count)
            chain = torch.ones(count, count, dtype=torch.bool).tril()
            for name, kernel in ATTENTION.items():
                model.use_attention_kernel(kernel)
                start = time.perf_counter()
                model(tokens, positions, cache, tree_mask=chain)
                if run >= 3:  # warm-up
                    samples.setdefault((name, count), []).append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(values) for key, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="models/swift-tiny")
    parser.add_argument("--contexts", default="1024,4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    status = kernels.load_cpu_kernels()
    if not status.loaded:
        raise SystemExit(f"error: {status.reason}")
    engine = load_engine(args.model_dir)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; decoder forward ms (ratio to T=1)")
    print("| context | attention | " + " | ".join(f"T={t}" for t in TOKENS) + " |")
    print("|---|---|" + "---|" * len(TOKENS))
    with torch.inference_mode():
        for context in (int(c) for c in args.contexts.split(",")):
            table = costs(engine.model, engine.config, context, args.repeats)
            for name in ATTENTION:
                cells = [
                    f"{table[(name, t)]:.2f} ({table[(name, t)] / table[(name, 1)]:.2f})" for t in TOKENS
                ]
                print(f"| {context:,} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
