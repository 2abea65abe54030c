"""Tree attention as a cascade: the math a GPU kernel pair implements, in PyTorch (issue #20).

A verify pass's T tree tokens attend to L committed keys (every one visible) and to the T tree
keys (visible through the ancestor mask). One masked kernel over L + T keys pays the mask and
the padding on all of them; a cascade splits the work where its shapes differ:

1. prefix block: queries against the L committed keys with no mask. The query heads that share a
   KV head are packed with the tree nodes as the rows of one matrix ([kv_heads, group·T, D],
   `pack_group_rows`), so each K/V row is read once for all of them and the block is a plain dense
   attention (tensor cores at 256 rows for 4 heads × 64 nodes), split over key ranges;
2. tree block: the same rows against the T tree keys with the ancestor mask (≤ 256 × 256);
3. merge: each part returns its unnormalised softmax numerator's normalised output and the
   log-sum-exp of its scores; `merge_partials` combines them exactly (split-K attention's merge).

Every function here is the reference the CUDA path is checked against; the CPU tests check the
cascade against `kernels.tree_attention_reference` and the merge against one softmax.
"""

from __future__ import annotations

import torch

from .kernels import unpack_tree_mask


def pack_group_rows(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """query [heads, T, D] -> [kv_heads, group·T, D]: row g·T + t is node t of query head
    kv_head·group + g (the heads sharing a KV head are consecutive, as in GQA checkpoints)."""
    heads, count, dim = query.shape
    return query.reshape(kv_heads, (heads // kv_heads) * count, dim)


def unpack_group_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `pack_group_rows`: [kv_heads, group·T, D] -> [heads, T, D]."""
    kv_heads, packed, dim = rows.shape
    return rows.reshape(heads, packed * kv_heads // heads, dim)


def padded_tree_size(nodes: int, tile: int = 16) -> int:
    """Trie slots rounded up to the kernel's row tile (padding nodes see only themselves)."""
    if nodes < 1 or tile < 1:
        raise ValueError(f"need at least one node and a positive tile, got {nodes} and {tile}")
    return -(-nodes // tile) * tile


def attend_partial(
    rows: torch.Tensor,  # [kv_heads, R, D]
    keys: torch.Tensor,  # [kv_heads, S, D]
    values: torch.Tensor,  # [kv_heads, S, D]
    scale: float,
    visible: torch.Tensor | None = None,  # [R, S] bool, None = every key
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `rows` over one block of keys -> (output [kv_heads, R, D] normalised within the
    block, log-sum-exp of the visible scores [kv_heads, R] in fp32; -inf where a row sees none)."""
    scores = torch.einsum("hrd,hsd->hrs", rows.float(), keys.float()) * scale  # [kv_heads, R, S]
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [kv_heads, R]
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a row that sees nothing: 0
    return torch.einsum("hrs,hsd->hrd", weights, values.float()), lse


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(output [..., R, D], lse [..., R]) of disjoint key blocks -> the attention over their union:
    each block weighs exp(lse_b - lse_total). Rows that see no key in any block give 0."""
    lses = torch.stack([lse for _, lse in parts])  # [B, ..., R]
    total = torch.logsumexp(lses, dim=0)  # [..., R]
    weights = torch.exp(lses - total).nan_to_num(0.0)  # [B, ..., R]; -inf - -inf is nan: 0
    return sum(weight[..., None] * out for weight, (out, _) in zip(weights, parts))


def split_key_ranges(length: int, splits: int) -> list[tuple[int, int]]:
    """`splits` contiguous key ranges covering [0, length) (flash-decoding's split over keys)."""
    if splits < 1:
        raise ValueError(f"need at least one split, got {splits}")
    if length <= 0:
        return [(0, 0)]
    step = -(-length // splits)
    return [(start, min(length, start + step)) for start in range(0, length, step)]


def cascade_tree_attention(
    query: torch.Tensor,  # [heads, T, D]
    keys: torch.Tensor,  # [kv_heads, prefix + T, D]
    values: torch.Tensor,  # [kv_heads, prefix + T, D]
    tree_mask: torch.Tensor,  # [T, ceil(T / 32)] int32, packed (`kernels.pack_tree_mask`)
    scale: float,
    prefix_splits: int = 1,
) -> torch.Tensor:
    """`kernels.tree_attention` computed as prefix block(s) + tree block + merge -> [heads, T, D]
    in the query's dtype. `prefix_splits` splits the committed keys as a split-K kernel would."""
    heads, count, _ = query.shape
    kv_heads, length, _ = keys.shape
    prefix = length - count
    rows = pack_group_rows(query, kv_heads)  # [kv_heads, group·T, D]
    parts = [
        attend_partial(rows, keys[:, start:end], values[:, start:end], scale)
        for start, end in split_key_ranges(prefix, prefix_splits)
        if end > start
    ]
    visible = unpack_tree_mask(tree_mask, count).repeat(heads // kv_heads, 1)  # [group·T, T]
    parts.append(attend_partial(rows, keys[:, prefix:], values[:, prefix:], scale, visible))
    return unpack_group_rows(merge_partials(parts), heads).to(query.dtype)
