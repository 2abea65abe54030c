"""Memory admission: refuse a request up front when its caches cannot fit, stating the numbers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokenswift_trt.model.engine import Engine

GIB = float(1 << 30)


class AdmissionError(ValueError):
    """The request would not fit in memory."""


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int  # already resident
    full_cache_bytes: int
    partial_cache_bytes: int
    tree_bytes: int
    positions: int

    @property
    def needed_bytes(self) -> int:
        return self.full_cache_bytes + self.partial_cache_bytes + self.tree_bytes


def plan_memory(engine: Engine, positions: int, kv_budget: int, tree_nodes: int) -> MemoryPlan:
    """Bytes for a request whose full cache holds `positions` slots (prompt + max tokens + tree)."""
    c = engine.config
    element = torch.tensor([], dtype=engine.dtype).element_size()
    per_position = 2 * c.num_layers * c.num_kv_heads * c.head_dim * element  # K and V, all layers
    weights = sum(p.numel() * p.element_size() for p in engine.model_parameters())
    # per node: mask row, hidden states, and the [V] rows of sampling every node at once (NodeTargets):
    # float32 logits and scores, float64 perturbed scores and noise (about 32 bytes per vocabulary entry)
    tree = tree_nodes * (tree_nodes + c.vocab_size * 32 + c.hidden_size * element * (c.num_layers + 1))
    return MemoryPlan(
        weights, per_position * positions, per_position * (kv_budget + 1) if kv_budget else 0, tree, positions
    )


def available_bytes(device: torch.device) -> int:
    """Free memory where the caches would live: CUDA free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        # free on the device, plus what torch's allocator holds cached but unused (it reuses that first)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + cached
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # unknown: do not refuse


def admit(plan: MemoryPlan, available: int) -> None:
    if plan.needed_bytes > available:
        raise AdmissionError(
            f"not enough memory: this request needs {plan.needed_bytes / GIB:.2f} GiB (full KV cache "
            f"{plan.full_cache_bytes / GIB:.2f} GiB for {plan.positions:,} positions, partial cache "
            f"{plan.partial_cache_bytes / GIB:.2f} GiB, tree buffers {plan.tree_bytes / GIB:.3f} GiB) but "
            f"{available / GIB:.2f} GiB is free (weights {plan.weights_bytes / GIB:.2f} GiB already loaded): "
            "lower max tokens or the partial KV budget"
        )
