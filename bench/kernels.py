"""`tokenswift-trt bench-kernels`: the tree-attention op against PyTorch SDPA with an explicit
mask, and against the memory-bandwidth time (K/V bytes read ÷ measured copy bandwidth).

On CUDA the op is the CUDA kernel (plugins_cuda/); on a CPU it is the PyTorch reference, which
only makes the command runnable end to end (small sizes), not a kernel measurement.
"""

from __future__ import annotations

import csv
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenswift_trt.runtime import kernels


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(call: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median seconds of `call` over `repeats` runs, each bracketed by device synchronisation."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_copy_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    elements = megabytes * (1 << 20) // 4
    source = torch.empty(elements, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    seconds = time_call(lambda: target.copy_(source), device, repeats)
    return 2 * source.numel() * 4 / seconds


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


def _time_case(device: torch.device, count: int, context: int, heads: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """(kernel seconds, masked-SDPA seconds) for T = count tree tokens over `context` cached keys."""
    length = context + count
    keys = torch.randn(kv_heads, length, head_dim, device=device, dtype=dtype)
    values = torch.randn(kv_heads, length, head_dim, device=device, dtype=dtype)
    query = torch.randn(heads, count, head_dim, device=device, dtype=dtype)
    tree = _tree_mask(count).to(device)
    packed = kernels.pack_tree_mask(tree)
    full_mask = torch.cat((torch.ones(count, context, dtype=torch.bool, device=device), tree), dim=1)
    scale = 1 / math.sqrt(head_dim)
    kernel_s = time_call(lambda: kernels.tree_attention(query, keys, values, packed, scale), device, repeats)
    sdpa_s = time_call(
        lambda: F.scaled_dot_product_attention(
            query[None], keys[None], values[None], attn_mask=full_mask, enable_gqa=heads != kv_heads
        ),
        device, repeats,
    )
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


def write_kernel_report(rows: Sequence[KernelTiming], bandwidth: float, out_dir: Path, meta: dict) -> list[Path]:
    """kernels.csv and kernels.json (figures + machine + command) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "kernels.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["tree_tokens", "context", "kernel_ms", "sdpa_ms", "speedup_vs_sdpa", "bandwidth_ms",
                         "kernel_over_bandwidth"])
        for row in rows:
            writer.writerow([row.tree_tokens, row.context, f"{row.kernel_ms:.4f}", f"{row.sdpa_ms:.4f}",
                             f"{row.speedup_vs_sdpa:.3f}", f"{row.bandwidth_ms:.4f}",
                             f"{row.kernel_over_bandwidth:.3f}"])
    json_path = out_dir / "kernels.json"
    payload = {
        "meta": {**meta, "copy_bandwidth_gb_s": bandwidth / 1e9, "python": platform.python_version(),
                 "torch": torch.__version__},
        "rows": [asdict(row) | {"speedup_vs_sdpa": row.speedup_vs_sdpa,
                                "kernel_over_bandwidth": row.kernel_over_bandwidth} for row in rows],
    }
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    return [csv_path, json_path]


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{properties.name} ({properties.multi_processor_count} SMs), CUDA {torch.version.cuda}"
    return f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
