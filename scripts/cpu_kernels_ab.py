"""Whole decoder forwards with this tree's compiled CPU kernels against those of an earlier git
revision, side by side: T new tokens (a root and T - 1 children, as a depth-1 tree verifies) over a
cache of `--contexts` positions.

    .venv/bin/python scripts/cpu_kernels_ab.py REV [--model-dir models/smollm2-135m] \
        [--contexts 1024,4096] [--repeats 20]

REV's `plugins_cuda/cpu/` sources are compiled into a second extension module; the engine's compiled
decoder (runtime/cpu_decoder.py) runs through one module, then the other, every round, so the
machine's drift hits both alike. Each cell is the median over the rounds, with the ratio to T = 1
of the same kernels in brackets. Prints a Markdown table.
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

from tokenswift_trt.runtime.engine import load_engine
from tokenswift_trt.runtime.kernels import CPU_CFLAGS, CPU_LDFLAGS, CPU_SOURCES
from tokenswift_trt.runtime.kv_cache import KVCache

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
    args = parser.parse_args()
    engine = load_engine(args.model_dir)
    decoder = engine.model.cpu_decoder
    if decoder is None:
        raise SystemExit(
            "this engine has no compiled CPU decoder (float32 CPU engines with the tiled kernel)"
        )
    with tempfile.TemporaryDirectory() as folder:
        modules = {args.revision: build_revision(args.revision, Path(folder)), "this tree": decoder.kernels}
    config = engine.config
    times: dict[tuple[int, str, int], list[float]] = {}
    contexts = [int(c) for c in args.contexts.split(",")]
    with torch.inference_mode():
        for context in contexts:
            cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, context + max(TOKENS))
            cache.keys[:, :, :context].normal_()
            cache.values[:, :, :context].normal_()
            for run in range(args.repeats + 3):
                for name, module in modules.items():
                    decoder.kernels = module
                    for count in TOKENS:
                        cache.length = context
                        tokens = torch.randint(0, config.vocab_size, (count,))
                        positions = torch.tensor([context] + [context + 1] * (count - 1))
                        mask = torch.eye(count, dtype=torch.bool)
                        mask[:, 0] = True
                        start = time.perf_counter()
                        engine.model(tokens, positions, cache, tree_mask=mask if count > 1 else None)
                        if run >= 3:  # warm-up
                            times.setdefault((context, name, count), []).append(
                                (time.perf_counter() - start) * 1e3
                            )
    print("| context | kernels | " + " | ".join(f"T={t} ms" for t in TOKENS) + " |")
    print("|---|---|" + "---|" * len(TOKENS))
    for context in contexts:
        for name in modules:
            medians = [statistics.median(times[(context, name, t)]) for t in TOKENS]
            cells = " | ".join(f"{m:.2f} ({m / medians[0]:.2f})" for m in medians)
            print(f"| {context:,} | {name} | {cells} |")


if __name__ == "__main__":
    main()
