"""Tree attention for a whole batch over a paged KV cache, in one launch per layer (Triton).

A batch's requests keep their K/V in fixed-size pages of one pool (`model/paged_cache.py`): page p of
a layer holds `page_size` consecutive positions of one request, and request b's block table lists its
pages in order, so position s of request b sits in page `tables[b, s // page_size]`, slot
`s % page_size`. Each request's new tokens (a tree to verify, an AR step, a chunk) are already written
after its committed ones. A query row attends to every committed position of its own request and to
the new tokens its packed tree mask shows (bit j of word j // 32: new token j, `tree_mask.pack_tree_mask`),
never to another request's.

One program per (query row, query head) walks its request's pages with an online softmax in float32:
the cost is one pass over the request's keys, whatever the other requests' lengths, and a batch of any
mix of lengths and trees is one launch. `ops.paged_tree_attention_reference` is the same function in
PyTorch (the tests compare them through Triton's interpreter on the CPU).

Imported only where chosen (Triton ships with CUDA builds of PyTorch); with TRITON_INTERPRET=1 set
before Triton is first imported, the program runs on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_tree_attention_kernel(
    q_ptr,  # [T, heads, D]
    k_ptr,  # [pages, kv_heads, page_size, D]: one layer's pages
    v_ptr,
    out_ptr,  # [T, heads, D]
    tables_ptr,  # [B, max_pages] int32
    segment_ptr,  # [T] int32: the request of each row
    prefix_ptr,  # [B] int32: its committed positions
    count_ptr,  # [B] int32: its new tokens
    mask_ptr,  # [T, words] int32 packed: which new tokens of its request a row sees
    scale,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_ks,
    stride_tb,
    stride_mt,
    GROUP: tl.constexpr,  # query heads per KV head
    PAGE: tl.constexpr,  # positions per page
    HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    request = tl.load(segment_ptr + row)
    prefix = tl.load(prefix_ptr + request)
    total = prefix + tl.load(count_ptr + request)
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, PAGE)
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + dims).to(tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    norm = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for start in range(0, total, PAGE):
        page = tl.load(tables_ptr + request * stride_tb + start // PAGE)
        position = start + slots
        valid = position < total
        base = page * stride_kp + kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :]
        keys = tl.load(k_ptr + base, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(keys * q[None, :], axis=1) * scale  # [PAGE]
        new = position - prefix  # the new token's index, < 0 for committed positions
        in_tree = new >= 0
        index = tl.where(in_tree, new, 0)
        word = tl.load(mask_ptr + row * stride_mt + index // 32, mask=valid & in_tree, other=0)
        seen = ((word >> (index % 32)) & 1) != 0
        visible = valid & (~in_tree | seen)
        scores = tl.where(visible, scores, float("-inf"))
        top = tl.maximum(best, tl.max(scores, axis=0))
        safe = tl.where(top == float("-inf"), 0.0, top)  # nothing visible yet: weights stay 0
        weights = tl.exp(scores - safe)
        rescale = tl.exp(best - safe)
        values = tl.load(v_ptr + base, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(weights[:, None] * values, axis=0)
        norm = norm * rescale + tl.sum(weights, axis=0)
        best = top
    out = acc / tl.where(norm > 0, norm, 1.0)  # a row that sees nothing gives 0
    tl.store(out_ptr + row * stride_qt + head * stride_qh + dims, out.to(out_ptr.dtype.element_ty))


def paged_tree_attention(
    query: torch.Tensor,  # [T, heads, D]: every request's new rows, one request after another
    key_pages: torch.Tensor,  # [pages, kv_heads, page_size, D]: one layer's pages
    value_pages: torch.Tensor,
    tables: torch.Tensor,  # [B, max_pages] int32: each request's pages in order
    prefix_lengths: torch.Tensor,  # [B] int32: each request's committed positions
    counts: torch.Tensor,  # [B] int32: each request's new rows (written after its committed ones)
    tree_masks: torch.Tensor,  # [T, words] int32: each row's packed mask over its request's new tokens
    scale: float,
) -> torch.Tensor:
    """-> [T, heads, D] in the query's dtype (see the module docstring)."""
    rows, heads, head_dim = query.shape
    _, kv_heads, page_size, _ = key_pages.shape
    if head_dim & (head_dim - 1) or page_size & (page_size - 1):
        raise ValueError(f"head_dim and page_size must be powers of two, got {head_dim} and {page_size}")
    query = query.contiguous()
    segments = torch.repeat_interleave(
        torch.arange(counts.numel(), dtype=torch.int32, device=query.device), counts.long()
    )
    out = torch.empty_like(query)
    masks = tree_masks.contiguous()
    _paged_tree_attention_kernel[(rows, heads)](
        query,
        key_pages,
        value_pages,
        out,
        tables,
        segments,
        prefix_lengths,
        counts,
        masks,
        scale,
        query.stride(0),
        query.stride(1),
        key_pages.stride(0),
        key_pages.stride(1),
        key_pages.stride(2),
        tables.stride(0),
        masks.stride(0),
        GROUP=heads // kv_heads,
        PAGE=page_size,
        HEAD_DIM=head_dim,
    )
    return out
