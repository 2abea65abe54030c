"""What each row a verification adds costs on this CPU, part by part: the compiled decoder stack, its
products alone, attention alone, and the LM head sampling reads (full float32 and float16-screened).

    .venv/bin/python experiments/row_costs.py [--model-dir models/smollm2-135m] [--contexts 1024,4096] \
        [--rows 1,4] [--repeats 30]

For each context the cache holds that many positions of random K/V; a verification of T rows is a root
and T - 1 children (a depth-1 tree, as tree `3` verifies with T = 4). Parts, each the median of
`--repeats` rounds, all parts and row counts taking turns in every round so that the machine's drift
hits them alike:

- stack: `LlamaModel.decode` of T tokens through the compiled decoder (products, attention, norms);
- products: each layer's four tiled products (fused Q/K/V, output, fused gate/up, down) on T rows,
  the model's own packed weights;
- attention: the tree-attention kernel over every layer's own K/V (read from memory, as in a step);
- head, full / screened: the LM head for T rows after the final norm, float32, and through the
  screened head under the paper's sampling (min-p 0.1, θ 1.2 over 256 tokens; model/screened_head.py).

Every part but attention runs right after a whole decoder pass, so that the weights come from memory
as they do in decoding. Prints a Markdown table, ms per call, with each part's ratio to its T = 1 cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig

PAPER = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=256)


def star(count: int) -> torch.Tensor:
    """[T, T] bool: a root and T - 1 children, each seeing itself and the root."""
    mask = torch.eye(count, dtype=torch.bool)
    mask[:, 0] = True
    return mask


def parts(
    model, cache: KVCache, context: int, count: int, window: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """The timed parts for T = `count` rows at `context` cached positions (see the module docstring)."""
    config = model.config
    module = model.cpu_decoder.kernels
    products = [w for i, w in enumerate(model.cpu_decoder.weights) if i % 10 in (1, 3, 6, 8)]
    tokens = torch.randint(0, config.vocab_size, (count,))
    positions = torch.arange(context, context + count)
    mask = star(count)
    packed_mask = kernels.pack_tree_mask(mask)
    x = torch.randn(count, config.hidden_size)
    inner = torch.randn(count, config.intermediate_size)
    windows = window.expand(count, -1).contiguous()
    query = torch.randn(config.num_heads, count, config.head_dim)
    scale = kernels.default_scale(config.head_dim)

    def stack() -> None:
        model(tokens, positions, cache, tree_mask=mask)
        cache.pending = 0

    def linears() -> None:
        for index, packed in enumerate(products):  # per layer Q/K/V, output, gate/up, down
            inputs = inner if index % 4 == 3 else x
            module.linear(inputs, packed, x.new_empty(0), packed.shape[0] * packed.shape[2])

    def attention() -> None:
        length = context + count
        for layer in range(config.num_layers):
            kernels.tree_attention(
                query, cache.keys[layer, :, :length], cache.values[layer, :, :length], packed_mask, scale
            )

    return {
        "stack": stack,
        "products": linears,
        "attention": attention,
        "head, full": lambda: model.lm_head(x),
        "head, screened": lambda: model.target_logits(x, PAPER, windows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="models/smollm2-135m")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    engine = load_engine(args.model_dir)
    model, config = engine.model, engine.config
    if model.cpu_decoder is None or model.screened_head is None:
        raise SystemExit("needs the compiled CPU kernels (x86 AVX2, a C++ compiler) and a float32 engine")
    os.environ["TOKENSWIFT_SCREENED_HEAD"] = "1"
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| context | part | " + " | ".join(f"T={t} ms" for t in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for context in (int(c) for c in args.contexts.split(",")):
        cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, context + max(rows))
        cache.keys[:, :, :context].normal_()
        cache.values[:, :, :context].normal_()
        cache.length = context
        window = torch.randint(0, config.vocab_size, (256,))
        times: dict[tuple[str, int], list[float]] = {}
        with torch.inference_mode():
            timed = {count: parts(model, cache, context, count, window) for count in rows}
            for round_index in range(args.repeats + 2):
                for count in rows:
                    for part, run in timed[count].items():
                        if part != "attention":  # weights from memory, as after a step
                            timed[count]["stack"]()
                        start = time.perf_counter()
                        run()
                        if round_index >= 2:  # warm-up
                            times.setdefault((part, count), []).append((time.perf_counter() - start) * 1e3)
        for part in timed[rows[0]]:
            first = statistics.median(times[(part, rows[0])])
            cells = []
            for count in rows:
                value = statistics.median(times[(part, count)])
                cells.append(f"{value:.2f}" + ("" if count == rows[0] else f" ({value / first:.2f})"))
            print(f"| {context:,} | {part} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
