"""The tree-attention op against PyTorch SDPA with an explicit mask, and against the
memory-bandwidth time (K/V bytes read ÷ measured copy bandwidth): kernels.csv and kernels.json.

On CUDA the op is the CUDA kernel (plugins_cuda/); on a CPU it is the PyTorch reference, which
only makes the tool runnable end to end (small sizes), not a kernel measurement. docs/kernels.md
quotes its figures.

    .venv/bin/python -m tools.bench_kernels --tree-sizes 1,64,128 --contexts 4096,32768,131072 \
        --out runs/kernels
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenswift_trt.bench.steps import device_description, measure_copy_bandwidth, time_call
from tokenswift_trt.environment import machine_meta
from tokenswift_trt.kernels import ops as kernels


class KernelBenchError(ValueError):
    """The kernel bench cannot run as asked (the message names the flag to change)."""


def check_kernel_request(
    device: str, tree_sizes: Sequence[int], heads: int, kv_heads: int, head_dim: int, repeats: int
) -> None:
    """One-line errors for sizes the op does not take, and for a CUDA device where the CUDA kernel
    cannot run (no GPU, no CUDA build, too little shared memory for `head_dim`)."""
    if max(tree_sizes) > kernels.MAX_TREE_TOKENS:
        raise KernelBenchError(
            f"--tree-sizes: the kernel takes at most {kernels.MAX_TREE_TOKENS} tree tokens"
        )
    if heads < 1 or kv_heads < 1 or heads % kv_heads or repeats < 1:
        raise KernelBenchError("--heads must be a positive multiple of --kv-heads, and --repeats at least 1")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise KernelBenchError(
                "--device cuda needs a CUDA GPU and a CUDA build of torch "
                "(use --device cpu for a smoke run of the reference)"
            )
        status = kernels.load_cuda_kernels()
        problem = (
            kernels.shared_memory_problem(status, head_dim, torch.device(device))
            if status.loaded
            else status.reason
        )
        if problem is not None:
            raise KernelBenchError(problem)


@dataclass
class KernelTiming:
    tree_tokens: int  # T
    context: int  # L cached positions (the tree's own T keys come on top)
    kernel_ms: float  # torch.ops.tokenswift.tree_attention
    sdpa_ms: float  # scaled_dot_product_attention with a boolean [T, L + T] mask
    bandwidth_ms: float  # K/V (+ query, output) bytes ÷ copy bandwidth

    @property
    def speedup_vs_sdpa(self) -> float:
        return self.sdpa_ms / self.kernel_ms

    @property
    def kernel_over_bandwidth(self) -> float:
        return self.kernel_ms / self.bandwidth_ms


def _tree_mask(count: int) -> torch.Tensor:
    """A valid tree: node i's parent is (i - 1) // 3 (branching 3), so each row sees its ancestors."""
    mask = torch.zeros(count, count, dtype=torch.bool)
    for node in range(count):
        walk = node
        while True:
            mask[node, walk] = True
            if walk == 0:
                break
            walk = (walk - 1) // 3
    return mask


def _input_sets(device: torch.device, bytes_per_set: int) -> int:
    """How many copies of the inputs to rotate through so that runs do not hit a warm L2 cache."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(8, math.ceil(3 * l2 / bytes_per_set)))


def _time_case(
    device: torch.device,
    count: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    repeats: int,
) -> tuple[float, float]:
    """(kernel seconds, masked-SDPA seconds) for T = count tree tokens over `context` cached keys.

    SDPA's figure is the faster of two forms: GQA by `enable_gqa`, and K/V expanded to every query
    head beforehand (expansion not timed), since which of them reaches a fused backend with a mask
    depends on the torch version.
    """
    length = context + count
    element = torch.tensor([], dtype=dtype).element_size()
    sets = _input_sets(device, 2 * kv_heads * length * head_dim * element)
    keys = [torch.randn(kv_heads, length, head_dim, device=device, dtype=dtype) for _ in range(sets)]
    values = [torch.randn(kv_heads, length, head_dim, device=device, dtype=dtype) for _ in range(sets)]
    queries = [torch.randn(heads, count, head_dim, device=device, dtype=dtype) for _ in range(sets)]
    tree = _tree_mask(count).to(device)
    packed = kernels.pack_tree_mask(tree)
    full_mask = torch.cat((torch.ones(count, context, dtype=torch.bool, device=device), tree), dim=1)
    scale = 1 / math.sqrt(head_dim)
    turn = [0]

    def rotating(call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]) -> Callable[[], object]:
        def run() -> object:
            turn[0] = (turn[0] + 1) % sets
            return call(queries[turn[0]], keys[turn[0]], values[turn[0]])

        return run

    kernel_s = time_call(
        rotating(lambda q, k, v: kernels.tree_attention(q, k, v, packed, scale)), device, repeats
    )
    sdpa_s = time_call(
        rotating(
            lambda q, k, v: F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=full_mask, enable_gqa=heads != kv_heads
            )
        ),
        device,
        repeats,
    )
    if heads != kv_heads:
        group = heads // kv_heads
        keys = [k.repeat_interleave(group, dim=0) for k in keys]
        values = [v.repeat_interleave(group, dim=0) for v in values]
        expanded_s = time_call(
            rotating(
                lambda q, k, v: F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=full_mask)
            ),
            device,
            repeats,
        )
        sdpa_s = min(sdpa_s, expanded_s)
    return kernel_s, sdpa_s


def bench_tree_attention(
    device: torch.device,
    tree_sizes: Sequence[int],
    contexts: Sequence[int],
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 20,
    on_row: Callable[[KernelTiming], None] | None = None,
) -> tuple[list[KernelTiming], float]:
    """One row per (T, L); returns (rows, copy bandwidth in bytes/s)."""
    bandwidth = measure_copy_bandwidth(device, 1024 if device.type == "cuda" else 128)
    element = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for context in contexts:
        for count in tree_sizes:
            kernel_s, sdpa_s = _time_case(device, count, context, heads, kv_heads, head_dim, dtype, repeats)
            moved = (2 * kv_heads * (context + count) + 2 * heads * count) * head_dim * element
            row = KernelTiming(count, context, kernel_s * 1e3, sdpa_s * 1e3, moved / bandwidth * 1e3)
            rows.append(row)
            if on_row:
                on_row(row)
    return rows, bandwidth


def write_kernel_report(
    rows: Sequence[KernelTiming], bandwidth: float, out_dir: Path, meta: dict
) -> list[Path]:
    """kernels.csv and kernels.json (figures, the machine, the date and the command) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "kernels.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "tree_tokens",
                "context",
                "kernel_ms",
                "sdpa_ms",
                "speedup_vs_sdpa",
                "bandwidth_ms",
                "kernel_over_bandwidth",
            ]
        )
        for row in rows:
            writer.writerow(
                [
                    row.tree_tokens,
                    row.context,
                    f"{row.kernel_ms:.4f}",
                    f"{row.sdpa_ms:.4f}",
                    f"{row.speedup_vs_sdpa:.4g}",
                    f"{row.bandwidth_ms:.4f}",
                    f"{row.kernel_over_bandwidth:.4g}",
                ]
            )
    json_path = out_dir / "kernels.json"
    payload = {
        "meta": {
            **meta,
            "copy_bandwidth_gb_s": bandwidth / 1e9,
            **machine_meta(),
        },
        "rows": [
            asdict(row)
            | {"speedup_vs_sdpa": row.speedup_vs_sdpa, "kernel_over_bandwidth": row.kernel_over_bandwidth}
            for row in rows
        ],
    }
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    return [csv_path, json_path]


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default="cuda", help="cuda: the CUDA kernel; cpu: the reference (smoke run)"
    )
    parser.add_argument("--tree-sizes", type=_ints, default=[1, 64, 128], help="tree tokens T (1,64,128)")
    parser.add_argument("--contexts", type=_ints, default=[4096, 32768, 131072], help="cached positions L")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, choices=[64, 128], default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/kernels"))
    args = parser.parse_args(argv)
    try:
        check_kernel_request(
            args.device, args.tree_sizes, args.heads, args.kv_heads, args.head_dim, args.repeats
        )
    except KernelBenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    try:
        rows, bandwidth = bench_tree_attention(
            device,
            args.tree_sizes,
            args.contexts,
            args.heads,
            args.kv_heads,
            args.head_dim,
            getattr(torch, args.dtype),
            args.repeats,
        )
    except torch.OutOfMemoryError:
        print("error: out of device memory: lower --contexts", file=sys.stderr)
        return 2
    meta = {
        "command": shlex.join(
            ["python", "-m", "tools.bench_kernels", *(sys.argv[1:] if argv is None else argv)]
        ),
        "device": device_description(device),
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "repeats": args.repeats,
    }
    written = write_kernel_report(rows, bandwidth, args.out, meta)
    print(f"{meta['device']}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("T | L | kernel ms | SDPA ms | speedup vs SDPA | bandwidth ms | kernel / bandwidth")
    for row in rows:
        print(
            f"{row.tree_tokens} | {row.context} | {row.kernel_ms:.3f} | {row.sdpa_ms:.3f} | "
            f"{row.speedup_vs_sdpa:.2f} | {row.bandwidth_ms:.3f} | {row.kernel_over_bandwidth:.2f}"
        )
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
