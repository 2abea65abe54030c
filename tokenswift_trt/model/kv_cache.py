"""Key/value caches: the full cache used by verification and the partial cache used by drafting.

Terms:
- committed slots: positions whose K/V are final, `[0, length)`;
- pending slots: what the last forward wrote after them (`attend_kv`); they are discarded unless
  `commit` or `keep` makes them committed. Decode code never touches the tensors directly.

Keys are stored after rotary embedding, so a cache slot can be attended to without knowing its
position; this is what lets the partial cache keep an arbitrary subset of positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.kernels.ops import kv_importance_select
from tokenswift_trt.kernels.transfer import to_device


class CacheFullError(RuntimeError):
    """A forward would write past the cache's preallocated capacity."""


def cache_zeros(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    settings: KernelConfig = KernelConfig(),
) -> torch.Tensor:
    """Zeros for a cache's K or V: on a CPU where the compiled kernels are built, on 2 MB pages where
    the OS grants them (plugins_cuda/cpu/linear_cpu.cpp, `zeros_on_huge_pages`: attention streams the
    whole cache at every step; kernel settings huge_pages and cpu_kernel), else `torch.zeros`."""
    if torch.device(device).type == "cpu" and settings.huge_pages:
        from tokenswift_trt.model.linear import tiled_kernels  # lazily: no compile at import

        module = tiled_kernels(settings)
        if module is not None:
            return module.zeros_on_huge_pages(list(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    """Full, static KV cache over all committed positions of one sequence."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        settings: KernelConfig = KernelConfig(),  # where its memory comes from (cache_zeros)
    ) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys = cache_zeros(shape, dtype, device, settings)  # [layers, kv_heads, capacity, head_dim]
        self.values = cache_zeros(shape, dtype, device, settings)
        self.capacity = capacity
        self.length = 0  # committed slots
        self.pending = 0  # slots written by the last forward after `length`

    @property
    def prefix_length(self) -> int:
        """Number of committed slots every new token may attend to."""
        return self.length

    def attend_kv(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new K/V [kv_heads, T, head_dim] as pending; return committed + pending [kv_heads, length +
        T, head_dim]."""
        count = keys.shape[1]
        end = self.reserve(count) + count
        self.keys[layer, :, self.length : end] = keys
        self.values[layer, :, self.length : end] = values
        self.pending = count
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def reserve(self, count: int) -> int:
        """Make the `count` slots after the committed ones pending (for a writer of its own, e.g. the
        compiled CPU decoder); returns the first one's index."""
        if self.length + count > self.capacity:
            raise CacheFullError(f"KV cache capacity {self.capacity} exceeded ({self.length} + {count})")
        self.pending = count
        return self.length

    def committed_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the committed K/V [layers, kv_heads, length, head_dim] (for engines that take K/V as
        inputs)."""
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def commit(self, count: int | None = None) -> None:
        """Make the first `count` pending slots (default all) committed."""
        count = self.pending if count is None else count
        if count > self.pending:
            raise ValueError(f"cannot commit {count} slots, only {self.pending} pending")
        self.length += count
        self.pending = 0

    def keep(self, indices: Sequence[int]) -> None:
        """Commit the pending slots at `indices` (ascending), compacted to follow the committed ones."""
        indices = list(indices)
        count = len(indices)
        if count and indices[-1] >= self.pending:
            raise ValueError("keep() index beyond the pending slots")
        index = to_device([self.length + i for i in indices], torch.long, self.keys.device)
        target = slice(self.length, self.length + count)
        self.keys[:, :, target] = self.keys.index_select(2, index)
        self.values[:, :, target] = self.values.index_select(2, index)
        self.length += count
        self.pending = 0

    def rollback(self, count: int) -> None:
        """Forget the last `count` committed slots."""
        if count > self.length:
            raise ValueError(f"cannot roll back {count} slots of {self.length}")
        self.length -= count
        self.pending = 0


class PartialKVCache:
    """Budgeted KV cache for the draft forward: sinks + top-scored positions + a recent region.

    After `select`, `budget - recent` slots hold the selected positions; committed tokens are then
    appended to the recent region; when it would overflow, the selection is redone on the full
    cache with the latest query. While the whole context fits in the budget it simply mirrors it.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        budget: int,
        sinks: int = 16,
        recent: int | None = None,
        scratch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        longest: int | None = None,
    ) -> None:
        """`longest`: the most positions the sequence will ever commit, when known; below the
        budget the cache only ever mirrors them, so only that many slots are allocated (a short
        request does not pay for a 4K-slot cache)."""
        if budget < 2:
            raise ValueError(f"partial KV budget must be at least 2, got {budget}")
        self.budget = budget
        self.sinks = min(sinks, budget // 2)
        self.recent = max(1, budget // 4) if recent is None else recent
        if not 1 <= self.recent < budget:
            raise ValueError(f"recent region {self.recent} must be in [1, budget)")
        held = budget if longest is None else max(1, min(budget, longest))
        shape = (num_layers, num_kv_heads, held + scratch, head_dim)
        self.keys = torch.zeros(
            shape, dtype=dtype, device=device
        )  # [layers, kv_heads, budget + scratch, head_dim]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        # positions[l, h, s]: absolute position held in slot s (for inspection and tests)
        self.positions = torch.full((num_layers, num_kv_heads, held), -1, dtype=torch.long, device=device)
        self.length = 0
        self.selections = 0  # how many times the selection ran

    @property
    def prefix_length(self) -> int:
        return self.length

    def attend_kv(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens' K/V go to scratch slots after the held ones and are never committed."""
        end = self.length + keys.shape[1]
        if end > self.keys.shape[2]:
            raise CacheFullError(f"partial cache scratch exceeded ({self.length} + {keys.shape[1]})")
        self.keys[layer, :, self.length : end] = keys
        self.values[layer, :, self.length : end] = values
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def committed_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the held K/V [layers, kv_heads, length, head_dim]."""
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def select(self, full: KVCache, queries: Sequence[torch.Tensor]) -> None:
        """Rebuild from the full cache; queries: per layer, the latest query [heads, head_dim]."""
        length = full.length
        keep = length if length <= self.budget else self.budget - self.recent
        for layer, query in enumerate(queries):
            index = kv_importance_select(
                full.keys[layer, :, :length], query.contiguous(), keep, self.sinks
            )  # [kv_heads, keep]; a query picked from a verify's rows is a strided view
            gather = index[:, :, None].expand(-1, -1, self.keys.shape[-1])
            self.keys[layer, :, :keep] = torch.gather(full.keys[layer, :, :length], 1, gather)
            self.values[layer, :, :keep] = torch.gather(full.values[layer, :, :length], 1, gather)
            self.positions[layer, :, :keep] = index
        self.length = keep
        if length > self.budget:
            self.selections += 1

    def append_from(self, full: KVCache, start: int, count: int, queries: Sequence[torch.Tensor]) -> None:
        """Add the full cache's committed slots [start, start + count); reselect on overflow."""
        if self.length + count > self.budget:
            self.select(full, queries)
            return
        target = slice(self.length, self.length + count)
        self.keys[:, :, target] = full.keys[:, :, start : start + count]
        self.values[:, :, target] = full.values[:, :, start : start + count]
        self.positions[:, :, target] = torch.arange(start, start + count, device=self.positions.device)
        self.length += count
