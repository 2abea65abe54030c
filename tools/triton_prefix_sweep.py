"""Launches of the Triton prefix block timed side by side on a GPU: which row and key tiles, warps and
pipeline stages run the cascade's prefix block fastest for a model's shape.

    python3 -m tools.triton_prefix_sweep [--model llama3.1-8b] [--contexts 32768,102400]
        [--tree-sizes 64,128] [--repeats 20] [--budget-s 200] [--out DIR]

For each (context, tree size): the packed rows of a verify ([kv_heads, group x T, head_dim], random
bf16) against that many committed keys of a cache of the model's shape, cut into the ranges the engine
would use (`cascade.flash_splits`). Every launch of the grid is first checked against the default
launch's output (relative error <= 1e-2; a launch that does not compile, e.g. out of shared memory,
is reported and skipped), then timed with CUDA events (median of --repeats, launches taking turns).
Prints ms and TFLOP/s per launch, then the best launch for the widest tree at the longest context as
`--kernel cascade_prefix=triton:BLOCK_M,BLOCK_N,WARPS,STAGES[,VARIANT]`, the kernel setting engines
take (docs/gpu.md). The launches cover the prefix block's three kernels
(prefix_config.PREFIX_VARIANTS; `tma` on Hopper and later only), each kernel at the tiles measured
best so far first: compiling all 51 may take minutes, so after --budget-s seconds no new launch is
compiled (those skipped are listed).
Writes prefix_sweep.json under --out. Needs a CUDA GPU and Triton.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenswift_trt.builder.build import BuildRequest, resolve
from tokenswift_trt.kernels.cascade import flash_splits, pack_group_rows, split_offsets
from tokenswift_trt.kernels.prefix_config import PREFIX_VARIANTS, PrefixConfig, default_prefix_config
from tokenswift_trt.model.config import config_from_dict, load_config

# each kernel at the tiles measured best so far first, so that a sweep cut short by --budget-s has timed
# those; then the measured kernel's other launches, then the split-loop kernels' over the likeliest tiles
FIRST = [
    PrefixConfig(m, n, w, s, variant)
    for m, n, w, s in ((128, 64, 8, 3), (64, 64, 4, 3))
    for variant in PREFIX_VARIANTS
]
REST = [
    PrefixConfig(m, n, w, s)
    for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    if not (m == 128 and w == 4)  # 128-row tiles on 4 warps spill registers (sm_90 and sm_80 compiles)
] + [
    PrefixConfig(m, n, w, s, variant)
    for variant in ("split", "tma")
    for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))
    if not (m == 128 and w == 4)
]
GRID = FIRST + [launch for launch in REST if launch not in FIRST]


def timed_ms(run) -> float:
    """ms of one `run()`, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def sweep(
    block, repeats: int, grid: list[PrefixConfig], deadline: float, compiled: set[PrefixConfig]
) -> tuple[dict[PrefixConfig, float], dict[PrefixConfig, str]]:
    """`block(launch)` runs the prefix block with a launch (None: the default) -> (median ms per launch
    that compiled and matched the default's outputs and log-sum-exps, the reason for every other
    launch). The launches take turns, one call each per round, so that a clock or power change hits them
    all alike. Past `deadline` (time.monotonic()) only launches in `compiled` (compiled by an earlier
    call: Triton caches them) are run; the ones that ran are added to it."""
    reference, reference_lse = (part.float() for part in block(None))
    usable, failed = [], {}
    for launch in grid:
        if launch not in compiled and time.monotonic() > deadline:
            failed[launch] = "skipped: the sweep's --budget-s ran out before it was compiled"
            continue
        try:
            outs, lses = block(launch)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - Triton's compile errors share no base class
            failed[launch] = (str(error).strip() or type(error).__name__).splitlines()[0][:120]
            continue
        compiled.add(launch)
        error = ((outs.float() - reference).norm() / reference.norm()).item()
        lse_error = (lses - reference_lse).abs().max().item()
        if error <= 1e-2 and lse_error <= 1e-2:
            usable.append(launch)
        else:
            failed[launch] = f"relative error {error:.3g}, log-sum-exp {lse_error:.3g} against the default"
    samples: dict[PrefixConfig, list[float]] = {launch: [] for launch in usable}
    for round_index in range(repeats):
        for launch in usable if round_index % 2 == 0 else usable[::-1]:
            samples[launch].append(timed_ms(lambda launch=launch: block(launch)))
    return {launch: statistics.median(times) for launch, times in samples.items()}, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.1-8b")
    parser.add_argument("--contexts", default="32768,102400")
    parser.add_argument("--tree-sizes", default="64,128")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--budget-s", type=float, default=200, help="seconds after which no new launch is compiled"
    )
    args = parser.parse_args()
    deadline, compiled = time.monotonic() + args.budget_s, set()
    if not torch.cuda.is_available():
        raise SystemExit("the sweep times the compiled kernel: it needs a CUDA GPU")
    from tokenswift_trt.kernels.triton_prefix import prefix_block  # Triton: CUDA builds of PyTorch

    preset, directory = resolve(BuildRequest(model=args.model, out=Path("."), random_weights=True))
    config = config_from_dict(preset.config) if preset is not None else load_config(directory)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    device = torch.device("cuda")
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [int(t) for t in args.tree_sizes.split(",")]
    generator = torch.Generator(device=device).manual_seed(0)
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    grid = [launch for launch in GRID if hopper or launch.variant != "tma"]  # TMA: Hopper and later
    rows_out = []
    for context, size in itertools.product(contexts, sizes):
        query = torch.randn(heads, size, dim, device=device, generator=generator).to(torch.bfloat16)
        rows = pack_group_rows(query, kv_heads).contiguous()  # [kv_heads, group·T, D]
        keys = torch.randn(kv_heads, context, dim, device=device, generator=generator).to(torch.bfloat16)
        values = torch.randn_like(keys)
        splits = flash_splits(rows.shape[1], kv_heads, context, processors)
        offsets = split_offsets(torch.tensor(context, device=device), splits)
        flops = 4 * heads * size * context * dim

        def block(launch, rows=rows, keys=keys, values=values, offsets=offsets, splits=splits):
            return prefix_block(rows, keys, values, offsets, dim**-0.5, splits, launch)

        timings, failed = sweep(block, args.repeats, grid, deadline, compiled)
        default = default_prefix_config(rows.shape[1], torch.cuda.get_device_capability())
        print(
            f"context {context}, T {size}: {rows.shape[1]} rows per KV head, {splits} ranges; "
            f"default {default.text()} {timings.get(default, float('nan')):.3f} ms",
            file=sys.stderr,
        )
        for launch, ms in sorted(timings.items(), key=lambda item: item[1]):
            rows_out.append(
                {
                    "context": context,
                    "tree_size": size,
                    "launch": launch.text(),
                    "ms": round(ms, 4),
                    "tflops": round(flops / ms / 1e9, 1),
                    "default": launch == default,
                }
            )
        for launch, reason in failed.items():
            print(f"  {launch.text()}: not timed ({reason})", file=sys.stderr)
    print("| context | T | launch (BLOCK_M,BLOCK_N,WARPS,STAGES[,VARIANT]) | ms | TFLOP/s | default |")
    print("|---|---|---|---|---|---|")
    for row in rows_out:
        print(
            f"| {row['context']} | {row['tree_size']} | {row['launch']} | {row['ms']:.3f} | "
            f"{row['tflops']:.0f} | {'yes' if row['default'] else ''} |"
        )
    widest = [r for r in rows_out if r["context"] == max(contexts) and r["tree_size"] == max(sizes)]
    if widest:
        best = min(widest, key=lambda r: r["ms"])
        print(f"--kernel cascade_prefix=triton:{best['launch']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "rows": rows_out,
        }
        (args.out / "prefix_sweep.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
