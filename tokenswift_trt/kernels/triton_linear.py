"""Batch-invariant linear layers for GPUs (kernel setting `batch_invariant=on`): a row's outputs are the same
bits whether it is multiplied alone (an AR step) or among up to 256 rows (a verify).

cuBLAS picks its kernel (tile shape, split over K) by the problem's shape, so a row's dot products are
summed in another order for M = 1 than for M = 128, and a bf16 verify's logits differ in their last
bits from the AR step's (docs/method.md, "In bf16 on a GPU"). Here every M <= 256 runs
the same program: rows in blocks of 64 (a lone row padded into the block), columns in blocks of 64, K cut
into `splits` fixed ranges chosen from K alone, each range summed tile by tile in order into an fp32
partial [splits, M, N]; a second program adds the partials in range order (and the bias) and rounds
once. Nothing in a row's arithmetic depends on M or on the other rows.

Imported only where chosen (Triton ships with CUDA builds of PyTorch). With TRITON_INTERPRET=1 set
before Triton is first imported, both programs run on CPU tensors through Triton's interpreter: how the
mechanics are tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # rows per program: a warpgroup's matrix instruction takes 64 rows
BLOCK_N = 64
BLOCK_K = 64
MAX_ROWS = 256  # verifies are at most 256 tokens; longer products (prefill) keep cuBLAS
SPLIT_KEYS = 1024  # K per range: K = 4,096 gives 4 ranges, 14,336 gives 14


@triton.jit
def _partial_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (nn.Linear's layout)
    partial_ptr,  # [splits, M, N] fp32
    rows,
    columns,
    depth,  # K
    range_length,  # K per range, a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row_block = tl.program_id(0)
    column_block = tl.program_id(1)
    split = tl.program_id(2)
    m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    n = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    start = split * range_length
    for first in range(start, tl.minimum(start + range_length, depth), BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + m[:, None] * stride_xm + k[None, :],
            mask=(m[:, None] < rows) & (k[None, :] < depth),
            other=0.0,
        )
        w = tl.load(
            w_ptr + n[None, :] * stride_wn + k[:, None],
            mask=(n[None, :] < columns) & (k[:, None] < depth),
            other=0.0,
        )
        acc += tl.dot(x, w)  # [BLOCK_M, BLOCK_N]: each row's sums in the same order whatever M is
    out = partial_ptr + split * rows * columns + m[:, None] * columns + n[None, :]
    tl.store(out, acc, mask=(m[:, None] < rows) & (n[None, :] < columns))


@triton.jit
def _reduce_kernel(
    partial_ptr,  # [splits, M, N] fp32
    bias_ptr,  # [N] or a dummy
    out_ptr,  # [M, N]
    splits,
    count,  # M * N
    columns,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = index < count
    total = tl.zeros([BLOCK], tl.float32)
    for split in range(0, splits):  # in range order: the same sum for every M
        total += tl.load(partial_ptr + split * count + index, mask=live, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + index % columns, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + index, total.to(out_ptr.dtype.element_ty), mask=live)


def splits_for(depth: int) -> int:
    """Fixed K ranges for an input width: from K alone, never from the number of rows."""
    return max(1, -(-depth // SPLIT_KEYS))


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` applies: up to MAX_ROWS rows of a 2-D-able input, last dims contiguous."""
    rows = x.numel() // max(1, x.shape[-1])
    return 0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.stride(-1) == 1 and x.dtype == weight.dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, batch-invariant per row."""
    depth = x.shape[-1]
    columns = weight.shape[0]
    flat = x.reshape(-1, depth)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    splits = splits_for(depth)
    range_length = triton.cdiv(triton.cdiv(depth, splits), BLOCK_K) * BLOCK_K  # K per range, whole tiles
    partial = torch.empty(splits, rows, columns, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(columns, BLOCK_N), splits)
    _partial_kernel[grid](
        flat,
        weight,
        partial,
        rows,
        columns,
        depth,
        range_length,
        flat.stride(0),
        weight.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        num_stages=3,
    )
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    count = rows * columns
    block = 1024
    _reduce_kernel[(triton.cdiv(count, block),)](
        partial,
        bias if bias is not None else partial,
        out,
        splits,
        count,
        columns,
        HAS_BIAS=bias is not None,
        BLOCK=block,
    )
    return out.view(*x.shape[:-1], columns)
