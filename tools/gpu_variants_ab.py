"""Step costs of one engine under several kernel variants, side by side in one process.

    python3 -m tools.gpu_variants_ab [--model llama3.1-8b] [--contexts 4096,102400] [--tree-sizes 1,64]
        [--variants kernel+fused,flash_cascade+fused,flash_cascade+fused+tail,flash_cascade+fused+tail+triton]
        [--rounds 2] [--out DIR]

A variant is an attention kernel (`kernel`: our CUDA tree-attention kernel, `flash_cascade`: the
FlashAttention cascade for every step, `auto`: the cascade where T x keys >= kernel_config.CASCADE_MIN_WORK
and the kernel elsewhere, as CUDA engines run by default, `sdpa`) with `+fused` for the fused
elementwise kernels and packed products (`LlamaModel.use_fused_elementwise`) and `+tail` for the
cascade's tree block and merge as one kernel (`--kernel cascade_tail=kernel`), `+triton` for its
prefix block through our Triton kernel (`--kernel cascade_prefix=triton`), `+invariant` for
batch-invariant products and norms and position-aligned attention (`--kernel batch_invariant=on`),
`+products` for the products and norms alone (`=products`). One random-weights engine serves them
all (the same weights, caches and GPU state); the variants take turns in every round, the order
reversed every other round, and each step's figure is the median over rounds of
`bench-steps`' own timing (CUDA-graph replays on a GPU). Prints a table of ms per step and each
variant's ratio to the first; writes variants.json under --out. On a CPU it runs too (slowly; a
check of the mechanics, e.g. --model swift-tiny).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from tokenswift_trt.bench.steps import (
    StepBenchError,
    measure_copy_bandwidth,
    measure_step_costs,
    random_engine,
)
from tokenswift_trt.kernels.config import CASCADE_MIN_WORK
from tokenswift_trt.model.engine import flash_cascade_problem

ATTENTION = ("kernel", "flash_cascade", "auto", "sdpa")


EXTRAS = ("fused", "tail", "triton", "invariant", "products")


def parse_variant(text: str) -> tuple[str, set[str]]:
    """`attention[+fused][+tail][+triton][+invariant|+products]` -> (attention, extras): fused elementwise
    kernels, the cascade's fused tail, its prefix block through the Triton kernel, batch-invariant
    products and norms."""
    attention, *extras = text.split("+")
    if attention not in ATTENTION or any(extra not in EXTRAS for extra in extras):
        raise SystemExit(
            f"variant {text!r}: an attention kernel ({', '.join(ATTENTION)}) with optional "
            + ", ".join("+" + extra for extra in EXTRAS)
        )
    return attention, set(extras)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.1-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", default="4096,102400")
    parser.add_argument("--tree-sizes", default="1,64")
    parser.add_argument("--kv-budget", type=int, default=4096)
    parser.add_argument(
        "--variants",
        default="kernel+fused,flash_cascade+fused,flash_cascade+fused+tail,flash_cascade+fused+tail+triton",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variants.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [int(t) for t in args.tree_sizes.split(",")]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if any(attention in ("flash_cascade", "auto") for attention, _ in variants) and device.type == "cuda":
        problem = flash_cascade_problem(dtype, 128, device)
        if problem is not None:
            raise SystemExit(f"flash_cascade cannot run here: {problem}")
    try:
        engine, _ = random_engine(args.model, dtype, device)
    except (StepBenchError, ValueError, RuntimeError) as error:
        raise SystemExit(str(error).splitlines()[0]) from None
    model = engine.model.torch_model
    # our tree kernel where it built (`auto` keeps it for narrow trees and short contexts)
    default_kernel = (
        model.cascade_fallback if model.attention_kernel == "flash_cascade" else model.attention_kernel
    )
    auto_work = CASCADE_MIN_WORK
    bandwidth = measure_copy_bandwidth(device)
    samples: dict[str, dict[tuple[int, str], list[float]]] = {}
    failed: dict[str, str] = {}  # variant -> the first line of its error
    floors: dict[tuple[int, str], float] = {}
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for attention, extras in order:
            name = attention + "".join("+" + extra for extra in EXTRAS if extra in extras)
            fused = "fused" in extras
            if attention in ("flash_cascade", "auto"):  # every tree / wide trees over long contexts
                fallback = default_kernel if default_kernel in ("tree_attention", "sdpa") else "sdpa"
                model.use_flash_cascade(0 if attention == "flash_cascade" else auto_work, fallback)
            else:
                model.use_attention_kernel(default_kernel if attention == "kernel" else attention)
            model.cascade_fused_tail = "tail" in extras  # the cascade's tree block and merge as one kernel
            model.cascade_prefix = "triton" if "triton" in extras else "flash"  # its prefix block's kernel
            # products and norms row by row, and (+invariant) position-aligned attention
            invariant = bool(extras & {"invariant", "products"})
            model.use_batch_invariant(invariant, attention="invariant" in extras)
            model.use_fused_elementwise(fused)  # packing stays once done; off runs the parts' views
            print(f"round {round_index + 1}: {name} ({model.attention_kernel})", file=sys.stderr, flush=True)
            if name in failed:
                continue
            try:
                costs = measure_step_costs(
                    engine,
                    contexts,
                    sizes,
                    args.kv_budget,
                    args.repeats,
                    bandwidth,
                    on_step=lambda c, n=name: print(  # partial figures survive a time limit
                        f"  {n} {c.context} {c.step} {c.seconds * 1e3:.3f} ms", file=sys.stderr, flush=True
                    ),
                )
            except StepBenchError as error:
                raise SystemExit(str(error)) from None
            except RuntimeError as error:  # a variant that breaks on this GPU: say so, time the others
                failed[name] = (
                    str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                )
                print(f"{name} failed: {failed[name]}", file=sys.stderr, flush=True)
                continue
            for cost in costs:
                samples.setdefault(name, {}).setdefault((cost.context, cost.step), []).append(cost.seconds)
                floors[(cost.context, cost.step)] = cost.bandwidth_seconds
    for name, reason in failed.items():
        print(f"{name}: not timed ({reason})")
    if not samples:
        raise SystemExit("no variant could be timed")
    names = list(samples)
    keys = list(samples[names[0]])
    medians = {name: {key: statistics.median(samples[name][key]) * 1e3 for key in keys} for name in names}
    header = " | ".join(f"{name} ms" + ("" if index == 0 else " (ratio)") for index, name in enumerate(names))
    print(
        f"{args.model} ({args.dtype}) on {device}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"{args.rounds} rounds"
    )
    print(f"| context | step | floor ms | {header} |")
    print("|---" * (3 + len(names)) + "|")
    for key in keys:
        base = medians[names[0]][key]
        cells = [f"{base:.3f}"] + [f"{medians[n][key]:.3f} ({medians[n][key] / base:.3f})" for n in names[1:]]
        print(f"| {key[0]} | {key[1]} | {floors[key] * 1e3:.3f} | " + " | ".join(cells) + " |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
            "failed": failed,
            "rows": [
                {
                    "variant": n,
                    "context": k[0],
                    "step": k[1],
                    "ms": round(medians[n][k], 4),
                    "floor_ms": floors[k] * 1e3,
                }
                for n in names
                for k in keys
            ],
        }
        (args.out / "variants.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
