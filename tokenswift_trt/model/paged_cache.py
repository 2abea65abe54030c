"""One pool of KV pages for every request of a model instance (the GPU form of batching).

`PagePool` holds the keys and values of all layers in fixed-size pages ([layers, pages, kv_heads,
page_size, head_dim] each) and hands pages out and takes them back; its size is set once, from the
instance's memory budget (`PagePool.pages_for`). A request's `PagedSequence` owns the pages it holds,
in order (its block table), grows them as its tokens need, writes its new tokens' K/V after its
committed ones, commits them, keeps the accepted nodes of a verified tree (moving their K/V into
place) and gives every page back when it ends. The batch's attention reads the pages through the
block tables (`kernels/triton_paged.py`): a request's memory is what its tokens take, rounded up to a
page, not its whole possible length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PagePoolFull(RuntimeError):
    """The pool has fewer free pages than a request needs (it waits, or is refused, by the caller)."""


class PagePool:
    """Every request's KV pages: `pages` of `page_size` positions, all layers."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ) -> None:
        if pages < 1 or page_size < 1 or page_size & (page_size - 1):
            raise ValueError(
                f"a pool needs pages >= 1 and a power-of-two page size, got {pages} x {page_size}"
            )
        shape = (num_layers, pages, num_kv_heads, page_size, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self._free = list(range(pages - 1, -1, -1))  # popped from the end: page 0 first

    @staticmethod
    def pages_for(
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
    ) -> int:
        """How many pages `budget_bytes` holds (keys and values, every layer)."""
        element = torch.empty((), dtype=dtype).element_size()
        page_bytes = 2 * num_layers * num_kv_heads * page_size * head_dim * element
        return budget_bytes // page_bytes

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """`count` free pages, or PagePoolFull with the numbers (nothing is taken then)."""
        if count > len(self._free):
            raise PagePoolFull(f"{count} KV pages needed, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def give_back(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))


class PagedSequence:
    """One request's KV in a `PagePool`: committed positions, then the pending ones of the last forward."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        # the block table: page i holds positions [i * page_size, (i + 1) * page_size); on the device too
        self.pages: list[int] = []
        self._table = torch.empty(0, dtype=torch.long, device=pool.keys.device)
        self.length = 0  # committed positions
        self.pending = 0  # positions written by the last forward after `length`

    @property
    def prefix_length(self) -> int:
        return self.length

    def reserve(self, count: int) -> int:
        """Make room for `count` new positions after the committed ones (taking pages as needed; raises
        PagePoolFull before anything changes); they are pending. Returns the first one's position."""
        size = self.pool.page_size
        needed = (self.length + count + size - 1) // size - len(self.pages)
        if needed > 0:
            self.pages += self.pool.take(needed)
            self._table = torch.tensor(self.pages, dtype=torch.long, device=self.pool.keys.device)
        self.pending = count
        return self.length

    def _slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> (pages [N], slots [N]) on the pool's device."""
        positions = positions.to(self.pool.keys.device)
        return self._table[positions // self.pool.page_size], positions % self.pool.page_size

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New K/V [kv_heads, T, head_dim] into this layer's pending positions (`reserve` first)."""
        count = keys.shape[1]
        if count != self.pending:
            raise ValueError(f"{count} new positions written, {self.pending} reserved")
        pages, slots = self._slots(torch.arange(self.length, self.length + count))
        self.pool.keys[layer, pages, :, slots] = keys.transpose(0, 1).to(self.pool.keys.dtype)
        self.pool.values[layer, pages, :, slots] = values.transpose(0, 1).to(self.pool.values.dtype)

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's committed + pending K/V [kv_heads, length + pending, head_dim] (a copy)."""
        pages, slots = self._slots(torch.arange(self.length + self.pending))
        keys = self.pool.keys[layer, pages, :, slots].transpose(0, 1)
        return keys, self.pool.values[layer, pages, :, slots].transpose(0, 1)

    def commit(self, count: int | None = None) -> None:
        """Make the first `count` pending positions (default all) committed."""
        count = self.pending if count is None else count
        if count > self.pending:
            raise ValueError(f"cannot commit {count} positions, only {self.pending} pending")
        self.length += count
        self.pending = 0

    def keep(self, indices: Sequence[int]) -> None:
        """Commit the pending positions at `indices` (ascending; a verified tree's accepted nodes), moved
        to follow the committed ones in order, in every layer."""
        if any(index >= self.pending for index in indices):
            raise ValueError(f"keep {list(indices)}: only {self.pending} positions pending")
        source_pages, source_slots = self._slots(self.length + torch.tensor(list(indices), dtype=torch.long))
        target_pages, target_slots = self._slots(torch.arange(self.length, self.length + len(indices)))
        for tensor in (self.pool.keys, self.pool.values):
            moved = tensor[:, source_pages, :, source_slots].clone()  # [N, layers, kv_heads, D]
            tensor[:, target_pages, :, target_slots] = moved
        self.length += len(indices)
        self.pending = 0

    def release(self) -> None:
        """Give every page back to the pool (the request ended, however it ended)."""
        self.pool.give_back(self.pages)
        self.pages, self.length, self.pending = [], 0, 0
        self._table = self._table[:0]

    def table(self, width: int) -> torch.Tensor:
        """The block table padded to `width` pages [width] int32 (a batch's table row)."""
        padded = self.pages + [0] * (width - len(self.pages))
        return torch.tensor(padded, dtype=torch.int32, device=self.pool.keys.device)
