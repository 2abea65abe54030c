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

from collections.abc import Callable

import torch

from tokenswift_trt.kernels.prefix_config import parse_prefix_backend
from tokenswift_trt.kernels.tree_mask import unpack_tree_mask

CASCADE_TAIL_OP = "tokenswift::cascade_tail"


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
    return merge_stacked(torch.stack([out for out, _ in parts]), torch.stack([lse for _, lse in parts]))


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """`merge_partials` of blocks stacked on dim 0: outs [B, ..., R, D], lses [B, ..., R] -> [..., R, D]."""
    total = torch.logsumexp(lses, dim=0)  # [..., R]
    weights = torch.exp(lses - total).nan_to_num(0.0)  # [B, ..., R]; -inf - -inf is nan: 0
    return (weights[..., None] * outs).sum(dim=0)


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


# ---------------------------------------------------------------- the prefix block through FlashAttention
#
# On CUDA the prefix block can run through PyTorch's own FlashAttention (`aten._flash_attention_forward`,
# its variable-length form): the packed rows of each KV head are one "sequence" of queries per key
# range, the key ranges are consecutive slices of the cache (cumulative offsets computed on the device
# from the committed length, so a captured graph serves every context), and the op returns each
# range's log-sum-exp for the merge. Splitting the keys is what fills the GPU: FlashAttention runs one
# program per (sequence, head, 128 query rows), and a verify has few rows (4 x 64 for 64 nodes of a
# 32/8-head model), so without splits 100K keys would be read by 16 programs.

FLASH_MIN_KEYS_PER_SPLIT = 512
FLASH_MAX_SPLITS = 32
FLASH_ROW_BLOCK = 128  # query rows per FlashAttention program


def flash_splits(rows: int, kv_heads: int, key_capacity: int, multiprocessors: int) -> int:
    """Key ranges for the prefix block: enough (range, KV head, row block) programs to give every
    multiprocessor two, ranges of at least FLASH_MIN_KEYS_PER_SPLIT keys, at most FLASH_MAX_SPLITS."""
    programs = kv_heads * -(-rows // FLASH_ROW_BLOCK)
    wanted = -(-2 * multiprocessors // programs)
    return max(1, min(wanted, FLASH_MAX_SPLITS, key_capacity // FLASH_MIN_KEYS_PER_SPLIT))


def split_offsets(prefix_length: torch.Tensor, splits: int) -> torch.Tensor:
    """[splits + 1] int32 offsets cutting the keys [0, prefix_length) into `splits` ranges whose
    lengths differ by at most one, computed where the 0-d `prefix_length` lives (no host read)."""
    steps = torch.arange(splits + 1, device=prefix_length.device, dtype=torch.int64)
    return (steps * prefix_length.to(torch.int64) // splits).to(torch.int32)


def flash_prefix_block(
    rows: torch.Tensor,  # [kv_heads, R, D]
    keys: torch.Tensor,  # [kv_heads, capacity, D]: the committed keys are [0, prefix_length)
    values: torch.Tensor,  # [kv_heads, capacity, D]
    prefix_length: torch.Tensor,  # 0-d integer tensor on the keys' device
    scale: float,
    splits: int,
    backend: str = "flash",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows over the committed keys in `splits` ranges, as the kernel returns them: (outputs
    [splits, kv_heads, R, D] in its dtype, each normalised within its range, log-sum-exps [splits,
    kv_heads, R] with +inf (flash) or -inf (triton) for an empty range, offsets [splits + 1]).
    `backend`: "flash" (PyTorch's FlashAttention on CUDA, the CPU flash op range by range elsewhere)
    or "triton" (`triton_prefix.prefix_block`, our own kernel; "triton:BM,BN,W,S[,VARIANT]" picks its
    launch)."""
    offsets = split_offsets(prefix_length, splits)  # [splits + 1]
    backend, launch = parse_prefix_backend(backend)
    if backend == "triton":
        from tokenswift_trt.kernels.triton_prefix import prefix_block  # Triton: CUDA builds of PyTorch only

        outs, lses = prefix_block(rows, keys, values, offsets, scale, splits, launch)
    elif rows.is_cuda:
        outs, lses = _flash_varlen(rows, keys, values, offsets, scale, splits)
    else:
        outs, lses = _flash_ranges_cpu(rows, keys, values, offsets, scale)
    return outs, lses, offsets


def _present_ranges(
    outs: torch.Tensor, lses: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs in fp32 or wider and log-sum-exps with -inf for every empty range: FlashAttention writes
    zeros there (which the merge then weighs 0) and a log-sum-exp of +inf, which must not win the merge."""
    present = (offsets[1:] > offsets[:-1])[:, None, None]  # [splits, 1, 1]
    dtype = torch.promote_types(outs.dtype, torch.float32)
    return outs.to(dtype), torch.where(present, lses.to(dtype), float("-inf"))


def _flash_varlen(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    scale: float,
    splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_heads, count, dim = rows.shape
    queries = rows.transpose(0, 1).repeat(splits, 1, 1)  # [splits·R, kv_heads, D]: one copy per range
    query_offsets = torch.arange(0, (splits + 1) * count, count, dtype=torch.int32, device=rows.device)
    longest = -(-keys.shape[1] // splits)  # bound on a range's length (they differ by at most one)
    # keys as [capacity, kv_heads, D]: a strided view of the cache (rows D apart, heads capacity·D)
    out, lse = torch.ops.aten._flash_attention_forward(
        queries,
        keys.transpose(0, 1),
        values.transpose(0, 1),
        query_offsets,
        offsets,
        count,
        longest,
        0.0,
        False,
        False,
        scale=scale,
    )[:2]
    outs = out.view(splits, count, kv_heads, dim).permute(0, 2, 1, 3)  # [splits, kv_heads, R, D]
    if lse.dim() == 3:  # [splits, kv_heads, R] (batch, heads, longest query run)
        return outs, lse
    return outs, lse.view(kv_heads, splits, count).transpose(0, 1)  # from [kv_heads, splits·R]


def _flash_ranges_cpu(
    rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_heads, count, dim = rows.shape
    dtype = torch.promote_types(rows.dtype, torch.float32)  # float64 stays float64 (tests)
    outs, lses = [], []
    bounds = offsets.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if end <= start:  # as FlashAttention leaves a row with no keys: zeros, log-sum-exp +inf
            outs.append(rows.new_zeros(kv_heads, count, dim, dtype=dtype))
            lses.append(rows.new_full((kv_heads, count), float("inf"), dtype=dtype))
            continue
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            rows[None], keys[None, :, start:end], values[None, :, start:end], scale=scale
        )
        outs.append(out[0].to(dtype))
        lses.append(lse[0].to(dtype))
    return torch.stack(outs), torch.stack(lses)


def flash_cascade_attention(
    query: torch.Tensor,  # [heads, T, D]
    keys: torch.Tensor,  # [kv_heads, capacity, D]: committed [0, prefix), the tree's own [prefix, prefix + T)
    values: torch.Tensor,  # [kv_heads, capacity, D]
    tree_visible: torch.Tensor,  # [T, T] bool on the keys' device: node i may see node j
    prefix_length: torch.Tensor,  # 0-d integer tensor on the keys' device
    scale: float,
    splits: int,
    fused_tail: bool = False,
    prefix_backend: str = "flash",
) -> torch.Tensor:
    """Tree attention as a cascade whose prefix block runs through FlashAttention (`flash_prefix_block`)
    and whose tree block and merge are `attend_partial` / `merge_stacked` (`fused_tail`: one op for
    both, `cascade_tail`, a kernel of our own on CUDA; `prefix_backend` "triton": the prefix block
    through our Triton kernel, `triton_prefix`) -> [heads, T, D] in the query's dtype. Every shape is
    fixed by T, the capacity and `splits`: it can be captured."""
    kv_heads = keys.shape[0]
    rows = pack_group_rows(query, kv_heads)  # [kv_heads, group·T, D]
    outs, lses, offsets = flash_prefix_block(rows, keys, values, prefix_length, scale, splits, prefix_backend)
    tail = cascade_tail if fused_tail else cascade_tail_reference
    return tail(
        query.contiguous(),
        keys,
        values,
        tree_visible,
        prefix_length.to(torch.int64),
        outs,
        lses,
        offsets,
        scale,
    )


def cascade_tail_reference(
    query: torch.Tensor,  # [heads, T, D]
    keys: torch.Tensor,  # [kv_heads, capacity, D]
    values: torch.Tensor,  # [kv_heads, capacity, D]
    tree_visible: torch.Tensor,  # [T, T] bool
    prefix_length: torch.Tensor,  # 0-d int64: the tree's keys start there
    prefix_outs: torch.Tensor,  # [splits, kv_heads, R, D] each range's normalised output
    prefix_lses: torch.Tensor,  # [splits, kv_heads, R] each range's log-sum-exp (+inf when empty)
    offsets: torch.Tensor,  # [splits + 1] int32: range bounds (equal bounds: an empty range)
    scale: float,
) -> torch.Tensor:
    """The cascade after its prefix block: the packed rows over the tree's own keys through the
    ancestor mask (fp32), merged with every non-empty range -> [heads, T, D] in the query's dtype."""
    heads, count, _ = query.shape
    kv_heads = keys.shape[0]
    rows = pack_group_rows(query, kv_heads)  # [kv_heads, group·T, D]
    outs, lses = _present_ranges(prefix_outs, prefix_lses, offsets)
    positions = prefix_length + torch.arange(count, device=keys.device)  # [T]
    visible = tree_visible.repeat(heads // kv_heads, 1)  # [group·T, T]
    tree_out, tree_lse = attend_partial(
        rows, keys.index_select(1, positions), values.index_select(1, positions), scale, visible
    )
    merged = merge_stacked(
        torch.cat((outs, tree_out[None].to(outs.dtype))), torch.cat((lses, tree_lse[None].to(lses.dtype)))
    )  # [kv_heads, group·T, D]
    return unpack_group_rows(merged, heads).to(query.dtype)


@torch.library.custom_op(CASCADE_TAIL_OP, mutates_args=())
def cascade_tail(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tree_visible: torch.Tensor,
    prefix_length: torch.Tensor,
    prefix_outs: torch.Tensor,
    prefix_lses: torch.Tensor,
    offsets: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`cascade_tail_reference` as one op: one kernel on CUDA once the CUDA kernels load
    (src/cascade_tail.cu: a warp per packed row, fp32 inside, the output rounded once)."""
    return cascade_tail_reference(
        query, keys, values, tree_visible, prefix_length, prefix_outs, prefix_lses, offsets, scale
    )


@cascade_tail.register_fake
def _cascade_tail_shape(
    query, keys, values, tree_visible, prefix_length, prefix_outs, prefix_lses, offsets, scale
):
    return query.new_empty(query.shape)  # contiguous, as the kernel's


def cascade_tail_cuda(module) -> Callable[..., torch.Tensor]:
    """The kernel where it applies (fp16/bf16, head_dim 64/128/256, outputs in the query's dtype,
    float32 log-sum-exps), the reference otherwise."""

    def run(
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tree_visible: torch.Tensor,
        prefix_length: torch.Tensor,
        prefix_outs: torch.Tensor,
        prefix_lses: torch.Tensor,
        offsets: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        usable = (
            query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] in (64, 128, 256)
            and prefix_outs.dtype == query.dtype
            and prefix_outs.stride(-1) == 1
            and prefix_lses.dtype == torch.float32
            and keys.stride(-1) == 1
            and keys.stride(1) == keys.shape[-1]
            and values.stride() == keys.stride()
            and tree_visible.dtype == torch.bool
            and all(t.device == query.device for t in (keys, values, tree_visible, prefix_length, offsets))
        )
        arguments = (query, keys, values, tree_visible, prefix_length, prefix_outs, prefix_lses, offsets)
        if not usable:
            return cascade_tail_reference(*arguments, scale)
        return module.cascade_tail(
            query.contiguous(),
            keys,
            values,
            tree_visible.contiguous(),
            prefix_length.to(torch.int64),
            prefix_outs,
            prefix_lses,
            offsets.to(torch.int32).contiguous(),
            scale,
        )

    return run
