"""Whole decoder forwards with this tree's compiled CPU kernels against those of an earlier git
revision, side by side: T new tokens (a root and T - 1 children, as a depth-1 tree verifies) over a
cache of `--contexts` positions.

    .venv/bin/python -m tools.cpu_kernels_ab REV [--model-dir models/smollm2-135m] \
        [--contexts 1024,4096] [--repeats 20] [--tokens 1,2,3,4,6] [--part decoder|attention|linear]

REV's `plugins_cuda/cpu/` sources are compiled into a second extension module; the engine's compiled
decoder (model/cpu_decoder.py) runs through one module, then the other, every round, so the
machine's drift hits both alike (which goes first rotates). Each cell is the median over the rounds,
with the ratio to the first `--tokens` value (T = 1 by default) of the same kernels in brackets.
Prints a Markdown table.

`--part attention` times the tree-attention kernel alone over the model's layers (random K/V of
`--contexts` keys, T rows per query head, a depth-1 tree's mask); `--part linear` the tiled products
alone (each layer's fused QKV, o, fused gate-up and down shapes, random packed weights, T rows; the
two modules' outputs are checked equal bit for bit: the products are batch-invariant and their
arithmetic order fixed). Both take turns between the modules as the decoder does.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from tokenswift_trt.kernels.ops import CPU_CFLAGS, CPU_LDFLAGS, CPU_SOURCES, pack_tree_mask
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.kv_cache import KVCache

TOKENS = (1, 2, 3, 4, 6)
SOURCE_DIR = "tokenswift_trt/plugins_cuda/cpu"


def build_revision(revision: str, folder: Path):
    """REV's CPU kernels as an extension module (its sources and headers taken with `git show`)."""
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{revision}:{SOURCE_DIR}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in listing:
        text = subprocess.run(
            ["git", "show", f"{revision}:{SOURCE_DIR}/{name}"], check=True, capture_output=True, text=True
        ).stdout
        (folder / name).write_text(text)
    return cpp_extension.load(
        name="tokenswift_cpu_kernels_" + revision.replace("^", "_parent").replace("~", "_back"),
        sources=[str(folder / name) for name in CPU_SOURCES],
        extra_cflags=list(CPU_CFLAGS),
        extra_ldflags=list(CPU_LDFLAGS),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision")
    parser.add_argument("--model-dir", default="models/smollm2-135m")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", default=",".join(str(t) for t in TOKENS), help="T values to time")
    parser.add_argument("--part", choices=("decoder", "attention", "linear"), default="decoder")
    args = parser.parse_args()
    tokens_list = [int(t) for t in args.tokens.split(",")]
    engine = load_engine(args.model_dir)
    decoder = engine.model.cpu_decoder
    if decoder is None:
        raise SystemExit(
            "this engine has no compiled CPU decoder (float32 CPU engines with the tiled kernel)"
        )
    with tempfile.TemporaryDirectory() as folder:
        modules = {args.revision: build_revision(args.revision, Path(folder)), "this tree": decoder.kernels}
    contexts = [0] if args.part == "linear" else [int(c) for c in args.contexts.split(",")]
    times: dict[tuple[int, str, int], list[float]] = {}
    with torch.inference_mode():
        for context in contexts:
            runner = RUNNERS[args.part](engine, modules, context, max(tokens_list))
            for run in range(args.repeats + 3):
                names = list(modules)
                names = names[run % len(names) :] + names[: run % len(names)]  # who goes first rotates
                for name in names:
                    for count in tokens_list:
                        elapsed = runner(name, count)
                        if run >= 3:  # warm-up
                            times.setdefault((context, name, count), []).append(elapsed * 1e3)
    print("| context | kernels | " + " | ".join(f"T={t} ms" for t in tokens_list) + " |")
    print("|---|---|" + "---|" * len(tokens_list))
    for context in contexts:
        for name in modules:
            medians = [statistics.median(times[(context, name, t)]) for t in tokens_list]
            cells = " | ".join(f"{m:.2f} ({m / medians[0]:.2f})" for m in medians)
            print(f"| {f'{context:,}' if context else '-'} | {name} | {cells} |")


def depth_one_mask(count: int) -> torch.Tensor:
    """[T, T] bool: a root and T - 1 children, each seeing the root and itself."""
    mask = torch.eye(count, dtype=torch.bool)
    mask[:, 0] = True
    return mask


def decoder_runner(engine, modules, context: int, most: int):
    """Seconds of one whole decoder forward of T tokens over `context` cached positions."""
    config, decoder = engine.config, engine.model.cpu_decoder
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, context + most)
    cache.keys[:, :, :context].normal_()
    cache.values[:, :, :context].normal_()

    def run(name: str, count: int) -> float:
        decoder.kernels = modules[name]
        cache.length = context
        tokens = torch.randint(0, config.vocab_size, (count,))
        positions = torch.tensor([context] + [context + 1] * (count - 1))
        start = time.perf_counter()
        engine.model(tokens, positions, cache, tree_mask=depth_one_mask(count) if count > 1 else None)
        return time.perf_counter() - start

    return run


def attention_runner(engine, modules, context: int, most: int):
    """Seconds of the tree-attention kernel alone over every layer: T rows per query head."""
    config = engine.config
    shape = (config.num_kv_heads, context + most, config.head_dim)
    keys = [torch.randn(shape) for _ in range(config.num_layers)]
    values = [torch.randn(shape) for _ in range(config.num_layers)]
    scale = config.head_dim**-0.5

    def run(name: str, count: int) -> float:
        module = modules[name]
        query = torch.randn(config.num_heads, count, config.head_dim)
        mask = pack_tree_mask(depth_one_mask(count))
        start = time.perf_counter()
        for layer_keys, layer_values in zip(keys, values, strict=True):
            module.tree_attention(
                query, layer_keys[:, : context + count], layer_values[:, : context + count], mask, scale
            )
        return time.perf_counter() - start

    return run


def linear_runner(engine, modules, context: int, most: int):
    """Seconds of every layer's four tiled products alone (random weights), T rows; the modules'
    outputs must be equal bit for bit."""
    config = engine.config
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = [(qkv, config.hidden_size), (config.hidden_size, config.num_heads * config.head_dim)]
    shapes += [
        (2 * config.intermediate_size, config.hidden_size),
        (config.hidden_size, config.intermediate_size),
    ]
    weights = [[torch.randn(out, inp) * 0.02 for out, inp in shapes] for _ in range(config.num_layers)]
    packed = {name: [[m.pack_linear(w) for w in layer] for layer in weights] for name, m in modules.items()}
    none = torch.empty(0)
    outputs: dict[tuple[str, int], torch.Tensor] = {}

    def run(name: str, count: int) -> float:
        module = modules[name]
        inputs = [
            torch.randn(count, inp, generator=torch.Generator().manual_seed(count)) for _, inp in shapes
        ]
        start = time.perf_counter()
        for layer in packed[name]:
            for (out, _), weight, x in zip(shapes, layer, inputs, strict=True):
                y = module.linear(x, weight, none, out)
        elapsed = time.perf_counter() - start
        outputs[(name, count)] = y
        other = [value for (key, rows), value in outputs.items() if rows == count and key != name]
        if other and not torch.equal(other[0], y):
            raise SystemExit(f"the modules' products differ at T = {count}")
        return elapsed

    return run


RUNNERS = {"decoder": decoder_runner, "attention": attention_runner, "linear": linear_runner}


if __name__ == "__main__":
    main()
