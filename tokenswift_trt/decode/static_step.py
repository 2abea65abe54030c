"""Fixed-shape forwards on a preallocated cache: the unit CUDA graphs capture.

A dynamic forward's shapes change every iteration (tree size T, context length L). Here every
forward runs at a bucketed size Tb >= T over the cache's whole capacity, with everything that
varies held in device tensors at fixed addresses:
- tokens / positions [Tb] (padding: token 0 at the root's position, seeing only itself),
- the tree mask [Tb, Tb] among the new tokens,
- the committed length, a 0-d tensor: the attention mask [Tb, capacity] and the cache slots the
  new K/V go to (length .. length + Tb - 1) are computed from it on the device.
So one graph per bucket, captured once, replays for every iteration at any context. On a CPU (or
with capture off) the same fixed-shape forward runs eagerly: identical arithmetic, which is what
the CPU tests compare against the dynamic path.

Attention reads the whole capacity (masked beyond the length), as static-cache decoders do; the
new tokens' K/V land in the cache's pending slots, so `commit`/`keep` work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenswift_trt.kernels.transfer import copy_from_host
from tokenswift_trt.model.decoder import ForwardOutput, LlamaModel, StaticAttention, aligned_fits
from tokenswift_trt.model.kv_cache import KVCache, PartialKVCache

# Tree sizes a fixed-shape step is padded to. Padding nodes cost as much as real ones (each attends
# to the whole cache), so the steps are fine: a 1,3,3,3 trie (41 nodes) runs at 48, not 64.
BUCKETS = (1, 16, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(count: int) -> int:
    """Smallest bucket holding `count` tokens; beyond the largest bucket, `count` itself."""
    return next((bucket for bucket in BUCKETS if bucket >= count), count)


class _SlotWriter:
    """Cache adapter for one fixed-shape forward: writes new K/V at device-side slots, reads all slots."""

    def __init__(self, cache: KVCache | PartialKVCache, slots: torch.Tensor) -> None:
        self.cache, self.slots = cache, slots  # slots [Tb] int64 on the cache's device

    @property
    def prefix_length(self) -> int:  # not used: the forward is given its full mask
        raise AttributeError("a fixed-shape forward takes an explicit attention mask")

    def attend_kv(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.keys[layer].index_copy_(1, self.slots, keys)  # keys [kv_heads, Tb, head_dim]
        self.cache.values[layer].index_copy_(1, self.slots, values)
        return self.cache.keys[layer], self.cache.values[layer]  # [kv_heads, capacity, head_dim]


@dataclass
class _Bucket:
    tokens: torch.Tensor  # [Tb] int64
    positions: torch.Tensor  # [Tb] int64
    tree_mask: torch.Tensor  # [Tb, Tb] bool
    route: bool | None = None  # the FlashAttention cascade or not (`LlamaModel.cascade_route`)
    aligned: bool = False  # position-aligned attention (every node shallower than 64 levels)
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    output: ForwardOutput | None = None  # the graph's static outputs


@dataclass
class StepCounters:
    eager_runs: int = 0
    graph_replays: int = 0
    captures: int = 0
    buckets_used: set[int] = field(default_factory=set)


def fixed_shape_forward(
    model: LlamaModel,
    cache: KVCache | PartialKVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    tree_mask: torch.Tensor,
    length: torch.Tensor,
    columns: torch.Tensor,
    cascade: bool | None = None,
    aligned: bool = False,
) -> ForwardOutput:
    """One forward of tokens/positions [Tb] (device) with tree_mask [Tb, Tb] bool (device) after the
    `length` (0-d int64, device) committed slots of `cache`, over its whole capacity (columns =
    arange(capacity) on the device): no value is read back to the host, so a CUDA graph can hold it.
    The new K/V land in slots length .. length + Tb - 1. `cascade`: the attention route the caller
    chose (`LlamaModel.cascade_route`); None decides by the capacity. `aligned`: every node is
    shallower than 64 levels, so a model with position-aligned attention may take it."""
    size = tokens.shape[0]
    slots = length + torch.arange(size, device=columns.device)  # [Tb]
    mask = (columns[None, :] < length).expand(size, -1).clone()  # [Tb, capacity]: committed
    mask[:, slots] = tree_mask  # the new tokens among themselves
    static = StaticAttention(
        full_mask=mask, tree_mask=tree_mask, prefix_length=length, cascade=cascade, aligned=aligned
    )
    return model.decode(tokens, positions, _SlotWriter(cache, slots), keep_queries=True, static=static)


def compiled_forward() -> Callable[..., ForwardOutput]:
    """`fixed_shape_forward` through torch.compile (gpt-fast's route to a step near the bandwidth
    floor: norms, rotary, SiLU·mul and the cache write fused around the matrix products), one
    compiled graph per bucket shape; on CUDA it runs inside our own captured graphs."""
    # every bucket is a shape of its own: allow one compiled graph per bucket, full and partial
    # (and per attention route: x2)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(BUCKETS))
    return torch.compile(fixed_shape_forward, dynamic=False)


class StaticForward:
    """Fixed-shape forwards of `model` on `cache` (a full or partial KV cache), by bucket;
    `compiled`: through torch.compile (`compiled_forward`)."""

    def __init__(
        self, model: LlamaModel, cache: KVCache | PartialKVCache, capture: bool, compiled: bool = False
    ) -> None:
        self.model, self.cache = model, cache
        self.forward = compiled_forward() if compiled else fixed_shape_forward
        device = cache.keys.device
        self.capacity = cache.keys.shape[2]
        self.capture = capture and device.type == "cuda"
        self.columns = torch.arange(self.capacity, device=device)  # [capacity]
        self.length = torch.zeros((), dtype=torch.long, device=device)  # committed slots, set before each run
        # by size, attention route and whether position-aligned attention may run (shallow trees)
        self.buckets: dict[tuple[int, bool | None, bool], _Bucket] = {}
        self.counters = StepCounters()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def fits(self, count: int) -> bool:
        return self.cache.length + bucket_for(count) <= self.capacity

    def run(
        self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None = None
    ) -> ForwardOutput:
        """tokens/positions [T] (device), tree_mask [T, T] bool on the host (None = causal) -> hidden
        [T, hidden], queries [T, heads, head_dim] per layer.

        Leaves T pending slots in the cache, as a dynamic forward does.
        """
        count = tokens.shape[0]
        size = bucket_for(count)
        if not self.fits(count):
            raise ValueError(f"fixed-shape forward of {size} tokens past cache capacity {self.capacity}")
        route = self.model.cascade_route(size, self.cache.length)  # the committed length is known here
        mask = torch.eye(size, dtype=torch.bool)  # built on the host (small), one copy to the device
        mask[:count, :count] = (
            torch.ones(count, count, dtype=torch.bool).tril() if tree_mask is None else tree_mask
        )
        aligned = self.model.aligned_attention and aligned_fits(mask)
        bucket = self.buckets.get((size, route, aligned)) or self._new_bucket(size, route, aligned)
        bucket.tokens[:count].copy_(tokens)
        bucket.tokens[count:].zero_()
        bucket.positions[:count].copy_(positions)
        bucket.positions[count:].copy_(positions[:1].expand(size - count))
        copy_from_host(bucket.tree_mask, mask)
        self.length.fill_(self.cache.length)
        self.counters.buckets_used.add(size)
        if self.capture:
            with torch.cuda.device(
                self.columns.device
            ):  # streams and graphs belong to the cache's GPU (cuda:N)
                if bucket.graph is None:
                    self._capture(bucket)
                bucket.graph.replay()
            self.counters.graph_replays += 1
            output = bucket.output
        else:
            output = self._forward(bucket)
            self.counters.eager_runs += 1
        assert output is not None and output.queries is not None
        if isinstance(self.cache, KVCache):  # the partial cache never commits draft tokens
            self.cache.pending = count
        # copies: the graph's output buffers are overwritten by the next replay
        return ForwardOutput(
            hidden=output.hidden[:count].clone(), queries=[q[:count].clone() for q in output.queries]
        )

    def _new_bucket(self, size: int, route: bool | None, aligned: bool) -> _Bucket:
        device = self.columns.device
        bucket = _Bucket(
            tokens=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            tree_mask=torch.eye(size, dtype=torch.bool, device=device),
            route=route,
            aligned=aligned,
        )
        self.buckets[(size, route, aligned)] = bucket
        return bucket

    def _forward(self, bucket: _Bucket) -> ForwardOutput:
        tokens, positions, tree_mask = bucket.tokens, bucket.positions, bucket.tree_mask
        return self.forward(
            self.model,
            self.cache,
            tokens,
            positions,
            tree_mask,
            self.length,
            self.columns,
            bucket.route,
            bucket.aligned,
        )

    def _capture(self, bucket: _Bucket) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture (allocator, kernel selection)
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.output = self._forward(bucket)
        bucket.graph = graph
        self.counters.captures += 1
