"""The processes of one data-parallel training run: `torchrun --nproc-per-node N -m tokenswift_trt
train-heads ...` starts N ranks (gloo on CPUs, NCCL on GPUs, one GPU per rank).

Every rank draws the same global batch of sequences (its generator is seeded alike and advanced
alike), trains on its share of it (every N-th sequence, from the rank-th), and the ranks sum their
gradients with one all-reduce before the optimiser step, as DistributedDataParallel does. The global
batch is `batch` x `grad_accum` sequences whatever N is, so one process and N ranks train the same
layers (within float rounding) and a run may be resumed on another number of ranks. Rank 0 writes
the checkpoints, the heads file and the report.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from tokenswift_trt.environment import launcher_assignment

T = TypeVar("T")
TIMEOUT = datetime.timedelta(hours=2)  # a collective waits this long for a slow rank (a long eval)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: rank `rank` of `size` (one process: 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the GPU of a rank on its node
    collective_device: str = "cpu"  # where the collectives' own tensors live (a GPU under NCCL)

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes files and prints progress."""
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's part of `items`: every size-th one, from the rank-th."""
        return list(items[self.rank :: self.size])

    def device(self, device: str) -> str:
        """`cuda` means this rank's own GPU of its node; other devices as given."""
        return f"cuda:{self.local_rank}" if self.size > 1 and device == "cuda" else device

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients of `parameters` over the ranks (one all-reduce of them all, flattened).
        A parameter without a gradient on this rank (no sequence of its share reached it) takes part
        as zeros."""
        if self.size == 1:
            return
        import torch.distributed as dist

        params = [p for p in parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # [sum of numels]
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            count = p.grad.numel()
            p.grad.copy_(flat[offset : offset + count].view_as(p.grad))
            offset += count

    def sum(self, value: float) -> float:
        """`value` summed over the ranks (a loss)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64, device=self.collective_device)
        dist.all_reduce(total)
        return float(total.item())

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        """Copy `tensor` from rank `source` into every rank's `tensor` (in place)."""
        if self.size == 1:
            return
        import torch.distributed as dist

        dist.broadcast(tensor, source)

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()


def join_ranks(device: str) -> Ranks:
    """The ranks of a torchrun launch, its process group started (NCCL for CUDA, else gloo); one
    process outside a launcher."""
    assigned = launcher_assignment()
    if assigned is None or assigned[1] == 1:
        return Ranks()
    import torch.distributed as dist

    rank, size, local_rank = assigned[0], assigned[1], assigned[2]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
    return Ranks(rank, size, local_rank, f"cuda:{local_rank}" if cuda else "cpu")


def leave_ranks(ranks: Ranks) -> None:
    """End the process group `join_ranks` started."""
    if ranks.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
