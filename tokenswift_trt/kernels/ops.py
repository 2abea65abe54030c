"""The two TokenSwift kernels, one semantics with three faces.

- `tree_attention`: T tree tokens attend to every committed cache slot and, among themselves,
  through a packed tree mask: bit j % 32 of word j // 32 in row i is set when node i may see
  node j (the layout TensorRT-LLM's attention uses for speculative decoding).
- `kv_importance_select`: which cached positions the partial (draft) cache keeps, per KV head.

Faces: the pure-PyTorch references below (what tests compare against); torch custom ops
`torch.ops.tokenswift.*` whose CUDA implementation comes from `plugins_cuda/` once
`load_cuda_kernels()` has compiled it, and whose CPU implementation is the reference until
`load_cpu_kernels()` compiles `plugins_cuda/cpu/` (float32 tree attention, what CPU engines
verify with, and the fused sampling step of model/sampling.py); and TensorRT plugins of the same names
built from the same CUDA
sources (`make plugins`).
"""

from __future__ import annotations

import functools
import logging
import math
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenswift_trt.kernels.tree_mask import (
    pack_tree_mask as pack_tree_mask,  # re-exported: the ops' mask form
)
from tokenswift_trt.kernels.tree_mask import unpack_tree_mask

LOGGER = logging.getLogger(__name__)
TREE_ATTENTION_OP = "tokenswift::tree_attention"
KV_SELECT_OP = "tokenswift::kv_importance_select"
ADD_RMS_NORM_OP = "tokenswift::add_rms_norm"
ROTARY_QK_OP = "tokenswift::rotary_qk"
SILU_MUL_OP = "tokenswift::silu_mul"
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_TREE_TOKENS = 256


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, head_dim], cos/sin [T, head_dim] -> rotated x [heads, T, head_dim]."""
    return x * cos + rotate_half(x) * sin


def tree_attention_reference(
    query: torch.Tensor,  # [heads, T, head_dim]
    keys: torch.Tensor,  # [kv_heads, prefix + T, head_dim]
    values: torch.Tensor,  # [kv_heads, prefix + T, head_dim]
    tree_mask: torch.Tensor,  # [T, ceil(T / 32)] int32, packed
    scale: float,
) -> torch.Tensor:
    """Softmax attention in fp32; returns [heads, T, head_dim] in the query's dtype."""
    heads, count, _ = query.shape
    kv_heads, key_length, _ = keys.shape
    prefix = key_length - count
    visible = torch.cat(
        (
            torch.ones(count, prefix, dtype=torch.bool, device=query.device),
            unpack_tree_mask(tree_mask, count),
        ),
        dim=1,
    )  # [T, prefix + T]
    group = heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=0)  # [heads, L, head_dim]
    v = values.float().repeat_interleave(group, dim=0)
    scores = torch.einsum("htd,hld->htl", query.float(), k) * scale  # [heads, T, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing gives 0
    return torch.einsum("htl,hld->htd", weights, v).to(query.dtype)


def paged_tree_attention_reference(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    tables: torch.Tensor,
    prefix_lengths: torch.Tensor,
    counts: torch.Tensor,
    tree_masks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`triton_paged.paged_tree_attention` in PyTorch, request by request, float32 softmax: query
    [T, heads, D] (the requests' new rows in turn), pages [pages, kv_heads, page_size, D], tables
    [B, max_pages], prefix_lengths and counts [B], tree_masks [T, words] packed -> [T, heads, D]."""
    out = torch.empty_like(query)
    _, kv_heads, page_size, head_dim = key_pages.shape
    group = query.shape[1] // kv_heads
    first = 0
    for request in range(counts.numel()):
        count = int(counts[request])
        prefix = int(prefix_lengths[request])
        total = prefix + count
        pages = tables[request, : (total + page_size - 1) // page_size].long()
        keys = key_pages[pages].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :total].float()
        values = value_pages[pages].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :total].float()
        visible = torch.cat(
            (
                torch.ones(count, prefix, dtype=torch.bool, device=query.device),
                unpack_tree_mask(tree_masks[first : first + count], count),
            ),
            dim=1,
        )  # [count, total]
        q = query[first : first + count].float().transpose(0, 1)  # [heads, count, D]
        k = keys.repeat_interleave(group, dim=0)
        v = values.repeat_interleave(group, dim=0)
        scores = torch.einsum("htd,hld->htl", q, k) * scale
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        out[first : first + count] = torch.einsum("htl,hld->thd", weights, v).to(query.dtype)
        first += count
    return out


def kv_importance_select_reference(
    keys: torch.Tensor, query: torch.Tensor, keep: int, sinks: int
) -> torch.Tensor:
    """Choose which cached positions a partial cache keeps, per KV head.

    keys [kv_heads, L, head_dim] (after rotary), query [heads, head_dim] (the latest query).
    Score = query·key summed over the query heads of each KV group; positions [0, sinks) are always
    kept, then the highest-scoring others (equal scores: lower position first). Returns ascending
    int64 indices [kv_heads, min(keep, L)].
    """
    kv_heads, length, head_dim = keys.shape
    if keep >= length:
        return torch.arange(length, device=keys.device).repeat(kv_heads, 1)
    sinks = min(sinks, keep)
    grouped = query.float().reshape(kv_heads, -1, head_dim).sum(dim=1)  # [kv_heads, head_dim]
    scores = torch.einsum("hd,hld->hl", grouped, keys.float())  # [kv_heads, L]
    order = scores[:, sinks:].sort(dim=1, descending=True, stable=True).indices[:, : keep - sinks] + sinks
    sink_index = torch.arange(sinks, device=keys.device).expand(kv_heads, sinks)
    return torch.cat((sink_index, order), dim=1).sort(dim=1).values


@torch.library.custom_op(TREE_ATTENTION_OP, mutates_args=())
def tree_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tree_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """[heads, T, head_dim] attention of the tree tokens; see the module docstring."""
    return tree_attention_reference(query, keys, values, tree_mask, scale)


@tree_attention.register_fake
def _tree_attention_shape(query, keys, values, tree_mask, scale):
    return torch.empty_like(query)


@torch.library.custom_op("tokenswift::tree_attention_static", mutates_args=())
def tree_attention_static(
    query: torch.Tensor,  # [heads, T, head_dim]
    keys: torch.Tensor,  # [kv_heads, capacity, head_dim]: the tree's K/V at [prefix, prefix + T)
    values: torch.Tensor,
    tree_mask: torch.Tensor,  # [T, ceil(T / 32)] int32
    prefix_length: torch.Tensor,  # 0-d int32 on the cache's device
    scale: float,
) -> torch.Tensor:
    """`tree_attention` over a whole-capacity cache whose prefix length lives on the device, so a
    captured CUDA graph serves every context length."""
    return tree_attention_static_reference(query, keys, values, tree_mask, prefix_length, scale)


def tree_attention_static_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tree_mask: torch.Tensor,
    prefix_length: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    end = int(prefix_length) + query.shape[1]
    return tree_attention_reference(query, keys[:, :end], values[:, :end], tree_mask, scale)


@tree_attention_static.register_fake
def _tree_attention_static_shape(query, keys, values, tree_mask, prefix_length, scale):
    return torch.empty_like(query)


@torch.library.custom_op(KV_SELECT_OP, mutates_args=())
def kv_importance_select(keys: torch.Tensor, query: torch.Tensor, keep: int, sinks: int) -> torch.Tensor:
    """Ascending kept positions [kv_heads, min(keep, L)]; see `kv_importance_select_reference`."""
    return kv_importance_select_reference(keys, query, keep, sinks)


@kv_importance_select.register_fake
def _kv_importance_select_shape(keys, query, keep, sinks):
    return keys.new_empty((keys.shape[0], min(keep, keys.shape[1])), dtype=torch.int64)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the model computes it: torch's fused op in float32; in other dtypes the sum of
    squares in float32, the normalised value rounded to the dtype, then scaled by the weight."""
    if x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm) [rows, hidden] each; delta None: (a copy of x, its RMSNorm)."""
    total = x.clone() if delta is None else x + delta
    return total, rms_norm_reference(total, weight, eps)


@torch.library.custom_op(ADD_RMS_NORM_OP, mutates_args=())
def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add and the next RMSNorm in one kernel on CUDA (src/rms_norm.cu):
    x, delta [rows, hidden] -> (x + delta, weight * norm(x + delta))."""
    return add_rms_norm_reference(x, delta, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_shape(x, delta, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def rotary_qk_reference(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated query [heads, T, D], rotated key [kv_heads, T, D]), contiguous, with cos/sin [T, D]:
    apply_rotary."""
    return apply_rotary(query, cos, sin).contiguous(), apply_rotary(key, cos, sin).contiguous()


@torch.library.custom_op(ROTARY_QK_OP, mutates_args=())
def rotary_qk(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's rotary embedding of queries and keys in one kernel on CUDA (src/rotary.cu), the same
    bits as `apply_rotary` (no reduction: every product and sum rounds as PyTorch's do)."""
    return rotary_qk_reference(query, key, cos, sin)


@rotary_qk.register_fake
def _rotary_qk_shape(query, key, cos, sin):
    return query.new_empty(query.shape), key.new_empty(key.shape)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 · inner] (gate, then up) -> SiLU(gate) · up [rows, inner]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@torch.library.custom_op(SILU_MUL_OP, mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """An MLP's activation over its packed gate-up product in one kernel on CUDA (src/silu_mul.cu),
    the same bits as `silu_mul_reference` (elementwise, rounded as PyTorch's ops)."""
    return silu_mul_reference(gate_up)


@silu_mul.register_fake
def _silu_mul_shape(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def source_dir() -> Path:
    """Where the CUDA sources live (the repository's or the installed package's plugins_cuda/)."""
    from importlib import resources

    return Path(str(resources.files("tokenswift_trt.plugins_cuda")))


@dataclass(frozen=True)
class KernelStatus:
    loaded: bool
    reason: str  # why not, when not loaded
    module: object | None = None  # the compiled extension (also has the *_into / *_gather entry points)


@functools.cache
def load_cuda_kernels(verbose: bool = False) -> KernelStatus:
    """Compile (once per process; torch also caches the build on disk) and register the CUDA
    implementations of both ops.

    Needs a CUDA build of torch, a GPU and nvcc. Returns why not instead of raising, so callers
    can fall back to the reference / SDPA path.
    """
    if not torch.cuda.is_available():
        return KernelStatus(False, "no CUDA device visible to torch (CPU build of torch or no GPU)")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 0):
        return KernelStatus(
            False,
            f"the kernels need compute capability 8.0+ (bf16 tensor cores), this GPU has "
            f"{capability[0]}.{capability[1]}",
        )
    try:
        from torch.utils import cpp_extension

        root = source_dir()
        module = cpp_extension.load(
            name="tokenswift_cuda_kernels",
            sources=[
                str(root / "torch_ops" / "ops.cpp"),
                str(root / "src" / "tree_attention.cu"),
                str(root / "src" / "kv_importance_select.cu"),
                str(root / "src" / "rms_norm.cu"),
                str(root / "src" / "rotary.cu"),
                str(root / "src" / "silu_mul.cu"),
                str(root / "src" / "cascade_tail.cu"),
            ],
            extra_include_paths=[str(root / "include")],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            verbose=verbose,
        )
    except (OSError, RuntimeError, ImportError, ValueError, subprocess.CalledProcessError) as error:
        # no nvcc or ninja, compiler error, ABI mismatch, a TORCH_CUDA_ARCH_LIST torch cannot parse
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return KernelStatus(False, f"building the CUDA kernels failed: {first_line}")
    tree_attention.register_kernel("cuda")(
        kernel_or_reference(module.tree_attention, tree_attention_reference)
    )
    tree_attention_static.register_kernel("cuda")(
        kernel_or_reference(module.tree_attention_static, tree_attention_static_reference)
    )
    kv_importance_select.register_kernel("cuda")(
        kernel_or_reference(module.kv_importance_select, kv_importance_select_reference)
    )
    add_rms_norm.register_kernel("cuda")(_add_rms_norm_cuda(module))
    rotary_qk.register_kernel("cuda")(_rotary_qk_cuda(module))
    silu_mul.register_kernel("cuda")(_silu_mul_cuda(module))
    from tokenswift_trt.kernels.cascade import (  # the cascade registers its own op
        cascade_tail,
        cascade_tail_cuda,
    )

    cascade_tail.register_kernel("cuda")(cascade_tail_cuda(module))
    return KernelStatus(True, "", module)


def _silu_mul_cuda(module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The kernel for contiguous fp16/bf16 [rows, 2 · inner], the reference otherwise."""

    def run(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and gate_up.dtype in (torch.float16, torch.bfloat16):
            return module.silu_mul(gate_up.contiguous())
        return silu_mul_reference(gate_up)

    return run


def _rotary_qk_cuda(module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The kernel for fp16/bf16 q/k with a contiguous last dimension, the reference otherwise."""

    def run(
        query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        usable = (
            query.dtype in (torch.float16, torch.bfloat16)
            and key.dtype == cos.dtype == sin.dtype == query.dtype
            and query.stride(-1) == 1
            and key.stride(-1) == 1
        )
        if not usable:
            return rotary_qk_reference(query, key, cos, sin)
        rotated_query, rotated_key = module.rotary_qk(query, key, cos, sin)
        return rotated_query, rotated_key

    return run


def _add_rms_norm_cuda(module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The kernel for contiguous fp16/bf16 rows, the reference otherwise (float32, strided inputs)."""

    def run(
        x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        usable = x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
        if not usable:
            return add_rms_norm_reference(x, delta, weight, eps)
        total, normed = module.add_rms_norm(
            x.contiguous(), None if delta is None else delta.contiguous(), weight.contiguous(), eps
        )
        return total, normed

    return run


CPU_HEAD_DIMS = (16, 32, 64, 128)
# how the CPU kernels compile (glibc's vector expf needs -ffast-math; parallel loops use OpenMP)
CPU_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
CPU_LDFLAGS = ("-fopenmp",)
CPU_SOURCES = (
    "module.cpp",
    "tree_attention_cpu.cpp",
    "sampling_cpu.cpp",
    "linear_cpu.cpp",
    "decoder_cpu.cpp",
    "screened_head_cpu.cpp",
)


def cpu_kernel_supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the CPU tree-attention kernel covers this element type and head size."""
    return dtype == torch.float32 and head_dim in CPU_HEAD_DIMS


def cpu_attention_kernel_pays() -> bool:
    """Whether the CPU tree-attention kernel beats SDPA on this processor: x86 with AVX2 or AVX-512
    (its tiles are 8- or 16-lane vectors; on AVX2 only 8-lane ones, which fit its 16 registers).
    On SmolLM2's decoder at 4K context it is faster than SDPA for 1 to 4 new tokens (docs/runtime.md).
    Elsewhere SDPA; the kernel
    setting cpu_kernel=on uses it anyway (tests, comparisons)."""
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))


@functools.cache
def load_cpu_kernels(verbose: bool = False) -> KernelStatus:
    """Compile (once per process; torch caches the build on disk) and register the CPU
    implementation of `tree_attention` (plugins_cuda/cpu/tree_attention_cpu.cpp; float32, head_dim
    16/32/64/128, every other case keeps the reference); the module also holds `gumbel_topk`, the
    fused sampling step (plugins_cuda/cpu/sampling_cpu.cpp, used through model/sampling.py).
    Needs a C++ compiler and ninja; returns why not instead of raising, so callers can fall back
    to SDPA."""
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name="tokenswift_cpu_kernels",
            sources=[str(source_dir() / "cpu" / name) for name in CPU_SOURCES],
            extra_cflags=list(CPU_CFLAGS),
            extra_ldflags=list(CPU_LDFLAGS),
            verbose=verbose,
        )
    except (OSError, RuntimeError, ImportError, ValueError, subprocess.CalledProcessError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return KernelStatus(False, f"building the CPU kernels failed: {first_line}")

    def run(
        query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tree_mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        rows_contiguous = keys.stride(-1) == 1 and keys.stride(-2) == keys.shape[-1]
        same_layout = keys.dtype == values.dtype == query.dtype and keys.stride() == values.stride()
        if cpu_kernel_supports(query.dtype, query.shape[-1]) and rows_contiguous and same_layout:
            return module.tree_attention(query.contiguous(), keys, values, tree_mask.contiguous(), scale)
        return tree_attention_reference(query, keys, values, tree_mask, scale)

    tree_attention.register_kernel("cpu")(run)
    return KernelStatus(True, "", module)


def cpu_tree_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tree_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """`tree_attention` through the compiled CPU kernel, called directly: the custom op's Python
    dispatch costs about as much as the attention of a short tree itself.
    query [heads, T, D] float32, keys/values [kv_heads, prefix + T, D] with contiguous rows."""
    status = load_cpu_kernels()
    if not status.loaded:
        raise RuntimeError(status.reason)
    return status.module.tree_attention(query.contiguous(), keys, values, tree_mask, scale)  # type: ignore[union-attr]


def kernel_or_reference(
    kernel: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """The CUDA implementation of an op: the kernel for the element types and head sizes it covers
    (judged by the first tensor argument, [..., head_dim]), the PyTorch reference for the rest, so
    a float32 engine on the same GPU as a bf16 one still gets answers."""

    def run(*args: object) -> torch.Tensor:
        first = args[0]
        assert isinstance(first, torch.Tensor)
        if kernel_supports(first.dtype, first.shape[-1]):
            return kernel(*args)
        return reference(*args)

    return run


def kernel_supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the CUDA kernels cover this element type and head size (else use SDPA)."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim in SUPPORTED_HEAD_DIMS


def shared_memory_problem(status: KernelStatus, head_dim: int, device: torch.device) -> str | None:
    """Why the loaded kernel cannot run `head_dim` on `device` (too little shared memory per block),
    or None."""
    needed = status.module.tree_attention_shared_bytes(head_dim)  # type: ignore[union-attr]
    allowed = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    if allowed is None:  # torch < 2.7 does not report it; the kernel's own launch check then decides
        return None
    if needed > allowed:
        return (
            f"head_dim {head_dim} needs {needed} bytes of shared memory per block, this GPU allows {allowed}"
        )
    return None
