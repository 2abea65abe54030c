"""The FlashAttention cascade's prefix block as a Triton kernel (kernel setting `cascade_prefix=triton`).

What it computes is `cascade._flash_varlen`'s: the packed rows of each KV head ([kv_heads, R, D],
R = group x T) attend without a mask to the committed keys, cut into `splits` consecutive ranges
whose bounds (`offsets`, [splits + 1] int32) live on the device; per range, every row's output
normalised within it and the log-sum-exp of its scores. Why a kernel of our own: PyTorch's
FlashAttention-2 runs this block at ~170-250 TFLOP/s on an H200,
while Triton lowers `tl.dot` to Hopper's wgmma and pipelines the key tiles' loads; and the grid
(row block, KV head, range) reads each range's keys for all of a head's rows in adjacent programs.

Three kernels compute it (`prefix_config.PREFIX_VARIANTS`, the launch's `variant`): `_prefix_kernel` ("loads",
masked loads of every key tile, the one measured on a GPU), `_prefix_kernel_split` ("split": whole key
tiles unmasked, one masked tail per range, the scale folded into the exponent, P·V accumulated in
place) and the same with the whole tiles' keys and values fetched through tensor-memory-accelerator
descriptors ("tma", Hopper and later).

Imported only when that backend is chosen (Triton ships with CUDA builds of PyTorch, not the CPU
build). With TRITON_INTERPRET=1 set before this module is imported, the kernel runs on CPU tensors
through Triton's interpreter: that is how it is tested without a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
import triton.runtime.errors
from triton.tools.tensor_descriptor import TensorDescriptor

from tokenswift_trt.kernels.prefix_config import TRITON_PREFIX_HEAD_DIMS, PrefixConfig, default_prefix_config

LOG2E = 1 / math.log(2)  # the kernel divides by the same constant


@triton.jit
def _store_range(
    out_ptr, lse_ptr, acc, top, total, split, head, rows, dims, row_ok,
    stride_out_split, stride_out_head, stride_out_row, stride_lse_split, stride_lse_head,
):  # fmt: skip
    """A row block's range: the output normalised within it and the log-sum-exp of its scores (base e);
    an empty range (no key, total 0) gives zeros and -inf."""
    seen = total > 0.0
    out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (top + tl.log2(tl.where(seen, total, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(
        out_ptr
        + split * stride_out_split
        + head * stride_out_head
        + rows[:, None] * stride_out_row
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(lse_ptr + split * stride_lse_split + head * stride_lse_head + rows, lse, mask=row_ok)


@triton.jit
def _prefix_kernel(
    rows_ptr,
    keys_ptr,
    values_ptr,
    out_ptr,
    lse_ptr,
    offsets_ptr,
    stride_rows_head,
    stride_rows_row,
    stride_keys_head,
    stride_keys_key,
    stride_values_head,
    stride_values_key,
    stride_out_split,
    stride_out_head,
    stride_out_row,
    stride_lse_split,
    stride_lse_head,
    row_count,
    scale_log2,  # softmax scale x log2(e): scores in base 2
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    row_block = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(offsets_ptr + split)
    end = tl.load(offsets_ptr + split + 1)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < row_count
    query = tl.load(
        rows_ptr + head * stride_rows_head + rows[:, None] * stride_rows_row + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, D]
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for first in range(start, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        key_tile = tl.load(
            keys_ptr + head * stride_keys_head + keys[None, :] * stride_keys_key + dims[:, None],
            mask=key_ok[None, :],
            other=0.0,
        )  # [D, BLOCK_N]
        scores = tl.dot(query, key_tile) * scale_log2  # [BLOCK_M, BLOCK_N] fp32
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        next_top = tl.maximum(top, tl.max(scores, 1))  # finite: a tile holds at least one key
        shrink = tl.exp2(top - next_top)
        weights = tl.exp2(scores - next_top[:, None])
        total = total * shrink + tl.sum(weights, 1)
        value_tile = tl.load(
            values_ptr + head * stride_values_head + keys[:, None] * stride_values_key + dims[None, :],
            mask=key_ok[:, None],
            other=0.0,
        )  # [BLOCK_N, D]
        acc = acc * shrink[:, None] + tl.dot(weights.to(value_tile.dtype), value_tile)
        top = next_top
    _store_range(
        out_ptr, lse_ptr, acc, top, total, split, head, rows, dims, row_ok,
        stride_out_split, stride_out_head, stride_out_row, stride_lse_split, stride_lse_head,
    )  # fmt: skip


@triton.jit
def _online_update(acc, top, total, raw, value_tile, key_ok, scale_log2, MASKED: tl.constexpr):
    """One key tile into a row block's online softmax: raw = query . keys [BLOCK_M, BLOCK_N] unscaled;
    with MASKED, the keys where key_ok is False weigh nothing (a tile holds at least one key)."""
    if MASKED:
        scores = tl.where(key_ok[None, :], raw * scale_log2, float("-inf"))
        next_top = tl.maximum(top, tl.max(scores, 1))
        weights = tl.exp2(scores - next_top[:, None])
    else:  # the scale goes into the exponent's argument: one multiply-add per score
        next_top = tl.maximum(top, tl.max(raw, 1) * scale_log2)
        weights = tl.exp2(raw * scale_log2 - next_top[:, None])
    shrink = tl.exp2(top - next_top)
    total = total * shrink + tl.sum(weights, 1)
    acc = tl.dot(weights.to(value_tile.dtype), value_tile, acc * shrink[:, None])  # accumulates in place
    return acc, next_top, total


@triton.jit
def _prefix_kernel_split(
    rows_ptr,
    keys_ptr,
    values_ptr,
    keys_desc,  # TMA: a descriptor of the keys [kv_heads, capacity, D], block [1, BLOCK_N, D]; else None
    values_desc,  # TMA: the same for the values
    out_ptr,
    lse_ptr,
    offsets_ptr,
    stride_rows_head,
    stride_rows_row,
    stride_keys_head,
    stride_keys_key,
    stride_values_head,
    stride_values_key,
    stride_out_split,
    stride_out_head,
    stride_out_row,
    stride_lse_split,
    stride_lse_head,
    row_count,
    scale_log2,  # softmax scale x log2(e): scores in base 2
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TMA: tl.constexpr,
):
    """`_prefix_kernel`'s outputs, with each range's whole key tiles unmasked and a masked tail."""
    row_block = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(offsets_ptr + split)
    end = tl.load(offsets_ptr + split + 1)
    whole_end = start + (end - start) // BLOCK_N * BLOCK_N
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    tile = tl.arange(0, BLOCK_N)
    row_ok = rows < row_count
    query = tl.load(
        rows_ptr + head * stride_rows_head + rows[:, None] * stride_rows_row + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, D]
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    everything = tl.full([BLOCK_N], 1, tl.int1)
    for first in range(start, whole_end, BLOCK_N):
        if TMA:
            key_tile = tl.trans(keys_desc.load([head, first, 0]).reshape(BLOCK_N, HEAD_DIM))  # [D, BLOCK_N]
            value_tile = values_desc.load([head, first, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            keys = first + tile
            key_tile = tl.load(
                keys_ptr + head * stride_keys_head + keys[None, :] * stride_keys_key + dims[:, None]
            )  # [D, BLOCK_N]
            value_tile = tl.load(
                values_ptr + head * stride_values_head + keys[:, None] * stride_values_key + dims[None, :]
            )  # [BLOCK_N, D]
        acc, top, total = _online_update(
            acc, top, total, tl.dot(query, key_tile), value_tile, everything, scale_log2, False
        )
    if whole_end < end:  # the range's last, partial tile: keys past its end are another range's or junk
        # masked pointer loads for both kernels: through the accelerator this one tile would wait on each
        # copy in turn and take its values through the registers to zero the junk past `end`
        keys = whole_end + tile
        key_ok = keys < end
        key_tile = tl.load(
            keys_ptr + head * stride_keys_head + keys[None, :] * stride_keys_key + dims[:, None],
            mask=key_ok[None, :],
            other=0.0,
        )
        value_tile = tl.load(
            values_ptr + head * stride_values_head + keys[:, None] * stride_values_key + dims[None, :],
            mask=key_ok[:, None],
            other=0.0,
        )
        acc, top, total = _online_update(
            acc, top, total, tl.dot(query, key_tile), value_tile, key_ok, scale_log2, True
        )
    _store_range(
        out_ptr, lse_ptr, acc, top, total, split, head, rows, dims, row_ok,
        stride_out_split, stride_out_head, stride_out_row, stride_lse_split, stride_lse_head,
    )  # fmt: skip


def prefix_block(
    rows: torch.Tensor,  # [kv_heads, R, D], last dim contiguous
    keys: torch.Tensor,  # [kv_heads, capacity, D], last dim contiguous
    values: torch.Tensor,  # [kv_heads, capacity, D], last dim contiguous
    offsets: torch.Tensor,  # [splits + 1] int32 on the keys' device
    scale: float,
    splits: int,
    launch: PrefixConfig | None = None,  # None: `default_prefix_config`
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (outputs [splits, kv_heads, R, D] in the rows' dtype, log-sum-exps [splits, kv_heads, R]
    in float32, -inf and zeros for an empty range). No host read: it can be captured."""
    kv_heads, count, dim = rows.shape
    if (
        dim not in TRITON_PREFIX_HEAD_DIMS
        or rows.stride(-1) != 1
        or keys.stride(-1) != 1
        or values.stride(-1) != 1
        or offsets.dtype != torch.int32
    ):
        raise ValueError(
            f"the Triton prefix block takes head_dim {TRITON_PREFIX_HEAD_DIMS} with contiguous rows and "
            f"int32 range offsets, got {dim} and {offsets.dtype}"
        )
    out = rows.new_empty(splits, kv_heads, count, dim)
    lse = torch.empty(splits, kv_heads, count, dtype=torch.float32, device=rows.device)
    if launch is None:  # the GPU's generation picks the kernel (the interpreter's CPU tensors: none)
        capability = torch.cuda.get_device_capability(rows.device) if rows.is_cuda else None
        launch = default_prefix_config(count, capability)
    grid = (triton.cdiv(count, launch.block_m), kv_heads, splits)
    kernel, descriptors, extra = _prefix_kernel, (), {}
    if launch.variant != "loads":
        kernel, descriptors, extra = _prefix_kernel_split, (None, None), {"TMA": launch.variant == "tma"}
    if launch.variant == "tma":  # Hopper and later: the engine refuses it elsewhere when it loads
        block = [1, launch.block_n, dim]
        descriptors = tuple(
            TensorDescriptor(cache, list(cache.shape), list(cache.stride()), block)
            for cache in (keys, values)
        )
    try:
        kernel[grid](
            rows,
            keys,
            values,
            *descriptors,
            out,
            lse,
            offsets,
            rows.stride(0),
            rows.stride(1),
            keys.stride(0),
            keys.stride(1),
            values.stride(0),
            values.stride(1),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            lse.stride(0),
            lse.stride(1),
            count,
            scale * LOG2E,
            BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n,
            HEAD_DIM=dim,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
            **extra,
        )
    except triton.runtime.errors.OutOfResources as error:  # the launch's tiles x stages on this GPU
        raise ValueError(
            f"the prefix block's launch {launch.text()} does not fit this GPU ({error.name}: "
            f"{error.required} > {error.limit}): take a smaller BLOCK_N or fewer stages in "
            "the kernel setting cascade_prefix, or the sweep's pick (tools/triton_prefix_sweep.py)"
        ) from None
    return out, lse
