"""Position-aligned attention: a query row's bits depend on its position and the keys it sees, not on
how many rows its step has nor on where the committed keys end and the tree's begin.

This is the attention part of AR's tokens in bf16 on a GPU (docs/method.md, "In bf16 on a GPU").
A verify's node at depth d reads the committed keys [0, n) from the cache and its d
ancestors and itself (positions n..n+d) from the step's own keys; an AR step at the same position p reads
keys [0, p) from the cache and itself. The two read the same key vectors at the same positions but, with
other kernels, split and reduce them differently. Here every row at position p computes:

- **dot tiles**: the positions below L(p) = 64 * max(p // 64 - 1, 0), in tiles of 64 aligned to absolute
  positions and ranges of `range_keys` (a multiple of 64) aligned too, each range's tiles folded in order
  by an online softmax in base 2 (`tl.dot`, one row block of 64 rows whatever the step's row count: a
  lone AR row is padded in). L(p) <= n whenever the row's depth is below 64, so these keys are all
  committed, in the cache, shared by every row of the block; a tile past a row's L(p) leaves that row's
  state untouched, bit for bit.
- **the tail**: positions L(p)..p (65 to 128 keys), each gathered from wherever it is (the cache below n,
  the step's keys of the row's ancestor at depth pos - n above), scored and weighed elementwise in fp32,
  one program per row.
- **the merge**: the ranges' states then the tail's, folded in that order, skipping empty ones exactly;
  the output normalised once and rounded to the query's dtype.

L(p), the tiles, the ranges and the order of the fold depend on p alone, so an AR step (one node at depth
0, n = p) and a verify's node at position p run the same arithmetic on the same values, provided a
product's row does not depend on the other rows of its tile (one `tl.dot` shape for both; checked on a
GPU by `tests/kernels/test_triton_aligned.py`). The model takes it for steps shallower than 64 levels
with the kernel setting `batch_invariant=on` (`LlamaModel.use_batch_invariant`). Imported only where Triton is
installed; with TRITON_INTERPRET=1 set before Triton's first import it runs
on CPU tensors through Triton's interpreter, which is how it is tested without a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tokenswift_trt.kernels.prefix_config import ALIGNED_HEAD_DIMS

TILE = 64  # keys per dot tile; part of the definition: AR and verify must share it
TAIL = 2 * TILE  # the tail's most keys: L(p)..p
BLOCK_M = 64  # rows per dot program, padded: a lone AR row is computed in the same tile shape
LOG2E = 1 / math.log(2)


@triton.jit
def _dot_kernel(
    rows_ptr,  # [kv_heads, R, D] packed rows (row g·T + t: node t of the group's head g)
    keys_ptr,  # [kv_heads, capacity, D]
    values_ptr,
    depths_ptr,  # [T] int32
    committed_ptr,  # 0-d int: n
    top_ptr,  # [parts, kv_heads, R] fp32
    total_ptr,
    acc_ptr,  # [parts, kv_heads, R, D] fp32
    stride_rows_head,
    stride_rows_row,
    stride_keys_head,
    stride_keys_key,
    stride_values_head,
    stride_values_key,
    stride_part,
    stride_part_head,
    stride_acc_part,
    stride_acc_head,
    stride_acc_row,
    row_count,
    tree_count,
    scale_log2,
    RANGE: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 products), the default otherwise
):
    row_block = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)
    committed = tl.load(committed_ptr).to(tl.int32)
    rows = row_block * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < row_count
    depth = tl.load(depths_ptr + rows % tree_count, mask=row_ok, other=0)
    position = committed + depth
    limit = tl.maximum(position // TILE_N - 1, 0) * TILE_N  # [BLOCK] dot tiles end here
    limit = tl.where(row_ok, tl.minimum(limit, committed), 0)  # (never past n: depths stay below 64)
    dims = tl.arange(0, HEAD_DIM)
    query = tl.load(
        rows_ptr + head * stride_rows_head + rows[:, None] * stride_rows_row + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    start = part * RANGE
    stop = tl.minimum(start + RANGE, tl.max(limit, 0))
    for first in range(start, stop, TILE_N):
        keys = first + tl.arange(0, TILE_N)
        key_ok = keys < committed
        key_tile = tl.load(
            keys_ptr + head * stride_keys_head + keys[None, :] * stride_keys_key + dims[:, None],
            mask=key_ok[None, :],
            other=0.0,
        )  # [D, TILE_N]
        visible = keys[None, :] < limit[:, None]  # [BLOCK, TILE_N]
        seen = first < limit  # [BLOCK]: this tile holds some of the row's keys (then all of them)
        products = tl.dot(query, key_tile, input_precision=PRECISION)  # [BLOCK, TILE_N] fp32
        scores = tl.where(visible, products * scale_log2, float("-inf"))
        next_top = tl.where(seen, tl.maximum(top, tl.max(scores, 1)), top)
        shrink = tl.where(seen, tl.exp2(top - next_top), 1.0)
        weights = tl.where(visible, tl.exp2(scores - next_top[:, None]), 0.0)
        value_tile = tl.load(
            values_ptr + head * stride_values_head + keys[:, None] * stride_values_key + dims[None, :],
            mask=key_ok[:, None],
            other=0.0,
        )  # [TILE_N, D]
        total = tl.where(seen, total * shrink + tl.sum(weights, 1), total)
        weighed = tl.dot(weights.to(value_tile.dtype), value_tile, input_precision=PRECISION)
        acc = tl.where(seen[:, None], acc * shrink[:, None] + weighed, acc)
        top = next_top
    offsets = part * stride_part + head * stride_part_head + rows
    tl.store(top_ptr + offsets, top, mask=row_ok)
    tl.store(total_ptr + offsets, total, mask=row_ok)
    acc_rows = acc_ptr + part * stride_acc_part + head * stride_acc_head + rows[:, None] * stride_acc_row
    tl.store(acc_rows + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _tail_kernel(
    rows_ptr,
    keys_ptr,
    values_ptr,
    tree_keys_ptr,  # [kv_heads, T, D]: the step's own keys, node t's at slot t
    tree_values_ptr,
    depths_ptr,
    ancestors_ptr,  # [T, max_depth + 1] int32: node t's ancestor at depth d (itself at its depth)
    committed_ptr,
    top_ptr,  # [kv_heads, R] fp32
    total_ptr,
    acc_ptr,  # [kv_heads, R, D] fp32
    stride_rows_head,
    stride_rows_row,
    stride_keys_head,
    stride_keys_key,
    stride_values_head,
    stride_values_key,
    stride_tree_keys_head,
    stride_tree_keys_key,
    stride_tree_values_head,
    stride_tree_values_key,
    stride_ancestors,
    stride_out_head,
    stride_acc_head,
    stride_acc_row,
    tree_count,
    scale_log2,
    TILE_N: tl.constexpr,
    TAIL_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    committed = tl.load(committed_ptr).to(tl.int32)
    node = row % tree_count
    position = committed + tl.load(depths_ptr + node)
    first = tl.maximum(position // TILE_N - 1, 0) * TILE_N
    keys = first + tl.arange(0, TAIL_N)
    visible = keys <= position
    cached = visible & (keys < committed)
    own = visible & (keys >= committed) & (keys - committed < stride_ancestors)  # never past the table
    slot = tl.load(ancestors_ptr + node * stride_ancestors + (keys - committed), mask=own, other=0)
    dims = tl.arange(0, HEAD_DIM)
    query = tl.load(rows_ptr + head * stride_rows_head + row * stride_rows_row + dims).to(tl.float32)
    key_rows = tl.load(
        keys_ptr + head * stride_keys_head + keys[:, None] * stride_keys_key + dims[None, :],
        mask=cached[:, None],
        other=0.0,
    ) + tl.load(
        tree_keys_ptr + head * stride_tree_keys_head + slot[:, None] * stride_tree_keys_key + dims[None, :],
        mask=own[:, None],
        other=0.0,
    )  # [TAIL_N, D]: each position from the one place that holds it (the other load adds +0.0)
    scores = tl.sum(query[None, :] * key_rows.to(tl.float32), 1) * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    top = tl.max(scores, 0)
    weights = tl.where(visible, tl.exp2(scores - top), 0.0)
    value_rows = tl.load(
        values_ptr + head * stride_values_head + keys[:, None] * stride_values_key + dims[None, :],
        mask=cached[:, None],
        other=0.0,
    ) + tl.load(
        tree_values_ptr
        + head * stride_tree_values_head
        + slot[:, None] * stride_tree_values_key
        + dims[None, :],
        mask=own[:, None],
        other=0.0,
    )
    acc = tl.sum(weights[:, None] * value_rows.to(tl.float32), 0)  # [D]
    tl.store(top_ptr + head * stride_out_head + row, top)
    tl.store(total_ptr + head * stride_out_head + row, tl.sum(weights, 0))
    tl.store(acc_ptr + head * stride_acc_head + row * stride_acc_row + dims, acc)


@triton.jit
def _merge_kernel(
    part_top_ptr,  # [parts, kv_heads, R]
    part_total_ptr,
    part_acc_ptr,  # [parts, kv_heads, R, D]
    tail_top_ptr,  # [kv_heads, R]
    tail_total_ptr,
    tail_acc_ptr,  # [kv_heads, R, D]
    out_ptr,  # [kv_heads, R, D] in the query's dtype
    stride_part,
    stride_part_head,
    stride_acc_part,
    stride_acc_head,
    stride_acc_row,
    stride_tail_head,
    stride_tail_acc_head,
    stride_tail_acc_row,
    stride_out_head,
    stride_out_row,
    parts,
    HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for part in range(0, parts):  # in order; an empty range (no key of this row) is skipped exactly
        part_top = tl.load(part_top_ptr + part * stride_part + head * stride_part_head + row)
        seen = part_top > float("-inf")
        next_top = tl.where(seen, tl.maximum(top, part_top), top)
        old = tl.where(seen, tl.exp2(top - next_top), 1.0)
        new = tl.where(seen, tl.exp2(part_top - next_top), 0.0)
        part_total = tl.load(part_total_ptr + part * stride_part + head * stride_part_head + row)
        part_acc = tl.load(
            part_acc_ptr + part * stride_acc_part + head * stride_acc_head + row * stride_acc_row + dims
        )
        total = tl.where(seen, total * old + part_total * new, total)
        acc = tl.where(seen, acc * old + part_acc * new, acc)
        top = next_top
    tail_top = tl.load(tail_top_ptr + head * stride_tail_head + row)  # never empty: it holds p itself
    next_top = tl.maximum(top, tail_top)
    old = tl.exp2(top - next_top)
    new = tl.exp2(tail_top - next_top)
    total = total * old + tl.load(tail_total_ptr + head * stride_tail_head + row) * new
    tail_acc = tl.load(tail_acc_ptr + head * stride_tail_acc_head + row * stride_tail_acc_row + dims)
    acc = acc * old + tail_acc * new
    out = acc / total
    tl.store(out_ptr + head * stride_out_head + row * stride_out_row + dims, out.to(out_ptr.dtype.element_ty))


def aligned_attention(
    query: torch.Tensor,  # [heads, T, D]: node t at position committed + depths[t]
    keys: torch.Tensor,  # [kv_heads, capacity, D]: the committed keys at [0, committed)
    values: torch.Tensor,  # [kv_heads, capacity, D]
    tree_keys: torch.Tensor,  # [kv_heads, T, D]: the step's own keys, node t's at t
    tree_values: torch.Tensor,  # [kv_heads, T, D]
    committed: torch.Tensor,  # 0-d integer tensor on the keys' device: n
    depths: torch.Tensor,  # [T] int32, each < TILE
    ancestors: torch.Tensor,  # [T, max_depth + 1] int32: node t's ancestor at depth d <= depths[t]
    scale: float,
    range_keys: int = 4096,
) -> torch.Tensor:
    """-> [heads, T, D] in the query's dtype: each node over the committed keys and its own path,
    position-aligned (module docstring). The host reads nothing: it can be captured. An AR step is
    T = 1, depths [0], ancestors [[0]], committed = its position."""
    heads, count, dim = query.shape
    kv_heads, capacity, _ = keys.shape
    if range_keys % TILE or range_keys <= 0:
        raise ValueError(f"range_keys must be a positive multiple of {TILE}, got {range_keys}")
    if ancestors.shape[1] > TILE:
        raise ValueError(f"position-aligned attention takes trees of depth below {TILE}")
    if dim not in ALIGNED_HEAD_DIMS:
        raise ValueError(f"position-aligned attention takes head_dim {ALIGNED_HEAD_DIMS}, got {dim}")
    for tensor in (keys, values, tree_keys, tree_values):
        if tensor.stride(-1) != 1:
            raise ValueError("keys and values need a contiguous last dimension")
    rows = query.reshape(kv_heads, (heads // kv_heads) * count, dim).contiguous()  # [kv_heads, R, D]
    row_count = rows.shape[1]
    parts = max(1, -(-capacity // range_keys))
    device = query.device
    part_top = torch.empty(parts, kv_heads, row_count, dtype=torch.float32, device=device)
    part_total = torch.empty_like(part_top)
    part_acc = torch.empty(parts, kv_heads, row_count, dim, dtype=torch.float32, device=device)
    tail_top = torch.empty(kv_heads, row_count, dtype=torch.float32, device=device)
    tail_total = torch.empty_like(tail_top)
    tail_acc = torch.empty(kv_heads, row_count, dim, dtype=torch.float32, device=device)
    out = torch.empty_like(rows)
    depths = depths.to(torch.int32).contiguous()
    ancestors = ancestors.to(torch.int32).contiguous()
    scale_log2 = scale * LOG2E
    _dot_kernel[(triton.cdiv(row_count, BLOCK_M), kv_heads, parts)](
        rows, keys, values, depths, committed, part_top, part_total, part_acc,
        rows.stride(0), rows.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        part_top.stride(0), part_top.stride(1), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        row_count, count, scale_log2,
        RANGE=range_keys, BLOCK=BLOCK_M, TILE_N=TILE, HEAD_DIM=dim,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2,
    )  # fmt: skip
    _tail_kernel[(row_count, kv_heads)](
        rows, keys, values, tree_keys, tree_values, depths, ancestors, committed,
        tail_top, tail_total, tail_acc,
        rows.stride(0), rows.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        tree_keys.stride(0), tree_keys.stride(1), tree_values.stride(0), tree_values.stride(1),
        ancestors.stride(0), tail_top.stride(0), tail_acc.stride(0), tail_acc.stride(1),
        count, scale_log2,
        TILE_N=TILE, TAIL_N=TAIL, HEAD_DIM=dim, num_warps=4,
    )  # fmt: skip
    _merge_kernel[(row_count, kv_heads)](
        part_top, part_total, part_acc, tail_top, tail_total, tail_acc, out,
        part_top.stride(0), part_top.stride(1), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        tail_top.stride(0), tail_acc.stride(0), tail_acc.stride(1), out.stride(0), out.stride(1),
        parts,
        HEAD_DIM=dim, num_warps=1,
    )  # fmt: skip
    return out.reshape(heads, count, dim)


def aligned_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tree_keys: torch.Tensor,
    tree_values: torch.Tensor,
    committed: int,
    depths: list[int],
    ancestors: list[list[int]],
    scale: float,
) -> torch.Tensor:
    """The same attention in float64, one node at a time: the committed keys, then the node's path."""
    heads, count, dim = query.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    out = torch.empty(heads, count, dim, dtype=torch.float64)
    for t in range(count):
        path = ancestors[t][: depths[t] + 1]
        for h in range(heads):
            kv = h // group
            k = torch.cat((keys[kv, :committed], tree_keys[kv, path])).double()
            v = torch.cat((values[kv, :committed], tree_values[kv, path])).double()
            weights = torch.softmax(k @ query[h, t].double() * scale, 0)
            out[h, t] = weights @ v
    return out


def tree_depths_and_ancestors(
    tree: torch.Tensor,  # [T, T] bool on the device: node t sees node s (its ancestors and itself)
    committed: torch.Tensor,  # 0-d integer tensor on the device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [T] int32, ancestors [T, min(T, 64)] int32: the cache slot of node t's ancestor at depth
    d, its step's own K/V sitting after the committed ones), on the device (no host read). Computed once
    per forward; every layer reads them."""
    count = tree.shape[0]
    depths = tree.sum(1, dtype=torch.int32) - 1  # [T]
    levels = torch.arange(min(count, TILE), device=tree.device, dtype=torch.int32)
    at_level = tree[:, None, :] & (depths[None, None, :] == levels[None, :, None])  # [T, width, T]
    ancestors = at_level.to(torch.int32).argmax(-1).to(torch.int32) + committed.to(torch.int32)
    return depths, ancestors


def tree_attention_aligned(
    query: torch.Tensor,  # [heads, T, D]
    keys: torch.Tensor,  # [kv_heads, >= committed + T, D]: the step's own K/V at committed + t
    values: torch.Tensor,
    committed: torch.Tensor,  # 0-d integer tensor on the device
    depths: torch.Tensor,  # [T] int32 (`tree_depths_and_ancestors`), each below 64
    ancestors: torch.Tensor,  # [T, width] int32 cache slots
    scale: float,
) -> torch.Tensor:
    """`aligned_attention` for a model's step (an AR step: T = 1, a verify: the tree), whose own K/V sit
    in the cache after the committed ones."""
    return aligned_attention(query, keys, values, keys, values, committed, depths, ancestors, scale)
