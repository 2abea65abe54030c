"""Where do AR and TokenSwift part, per dtype and step path? Token-for-token equality with AR needs
a verify that rounds each row's logits exactly as a 1-token step does.

    python3 -m tools.ar_divergence --model-dir models/swift-tiny --device cuda --dtypes bfloat16,float32

For each dtype, sampling (greedy, the paper's) and step path (fixed-shape/CUDA graphs, eager):
AR twice (is it reproducible?), then TokenSwift with trees 3,3,3 (drafting from the verify pass)
and 1,3,3,3 (partial-cache drafting); prints whether the tokens equal AR's and the first position
where they do not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.kernels.config import KernelConfig, parse_kernel_settings
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig

SAMPLINGS = {
    "greedy": SamplingConfig(temperature=0),
    "paper": SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=256),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/swift-tiny"))
    parser.add_argument("--prompt-file", type=Path, default=Path("models/swift-tiny/prompt.txt"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument(
        "--full-precision-reductions",
        action="store_true",
        help="forbid cuBLAS's reduced-precision (bf16/fp16) split-K reductions: does AR then equal TS?",
    )
    parser.add_argument(
        "--kernel", action="append", default=[], metavar="NAME=VALUE", help="a kernel setting (repeatable)"
    )
    args = parser.parse_args(argv)
    settings = KernelConfig().updated(parse_kernel_settings(args.kernel))
    if args.full_precision_reductions:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    prompt = TextCodec.from_dir(args.model_dir).encode(args.prompt_file.read_text(encoding="utf-8"))[:400]
    for dtype_name in args.dtypes.split(","):
        engine = load_engine(
            args.model_dir, dtype=getattr(torch, dtype_name), device=args.device, kernels=settings
        )
        for name, sampling in SAMPLINGS.items():
            for static in (True, False):
                base = dict(
                    max_new_tokens=args.tokens,
                    sampling=sampling,
                    seed=1,
                    ignore_eos=True,
                    static_steps=static,
                )
                ar, _ = generate(engine, prompt, GenerationConfig(method="ar", **base))
                again, _ = generate(engine, prompt, GenerationConfig(method="ar", **base))
                for tree, source in (("3,3,3", "verify"), ("1,3,3,3", "partial")):
                    config = GenerationConfig(tree=tree, draft_source=source, **base)
                    tokens, stats = generate(engine, prompt, config)
                    first = next((i for i, (a, b) in enumerate(zip(ar, tokens)) if a != b), None)
                    print(
                        f"{dtype_name:9} {name:6} fixed-shape={static!s:5} tree {tree:8} AR reproducible "
                        f"{ar == again}  tokens equal AR {tokens == ar}  first difference {first}  "
                        f"tokens/iteration {stats.new_tokens / max(stats.iterations, 1):.2f}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
