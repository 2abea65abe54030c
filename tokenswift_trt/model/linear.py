"""Linear layers whose inference on a CPU runs on a prepacked weight.

Why: with PyTorch's default CPU path (MKL sgemm) a float32 linear over M rows costs about M times
one row on AMD EPYC CPUs (MKL takes its generic code path there), so verifying a 4-token tree
would pay several AR steps in its matmuls. Two packed layouts:

- "tiled" (float32 on x86 with AVX2, the default where the CPU kernels build): our own kernel,
  plugins_cuda/cpu/linear_cpu.cpp. On SmolLM2-135M's layer shapes one row streams the weights
  faster than oneDNN, a few rows cost about what one does, and it is batch-invariant:
  a row's outputs are the same bits whatever other rows share the call, so an AR step and a tree
  verification compute a token's logits identically. It takes up to TILED_MAX_ROWS rows; a
  prompt's chunks run PyTorch's own product on the unpacked weight.
- "onednn" (bfloat16, other processors, or `cpu_kernel=off`): the weight reordered once
  into oneDNN's blocked layout; a few rows cost little more than one.

Measured with `python -m tools.cpu_step_costs` (docs/bench/cpu-verify-rows holds a run).

Half-precision packing (`pack(half=True)`, tiled layout only): the packed copy is float16, widened
to float32 as the kernel loads it, so a one-row product streams half the bytes; its outputs are
exactly the float32 kernel's for the weight rounded to float16. For products whose rounding only
changes proposals, never outputs: the draft layers' (`load_engine`).

`Linear` is `nn.Linear` (same parameters, same state-dict keys, same autograd, export and GPU
behaviour) plus `pack()`. Once packed, a CPU forward under `torch.inference_mode()` uses the
packed copy. It is dropped as soon as the weight changes (a new Parameter, an in-place update,
another device or dtype), so training and reloading stay correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenswift_trt.kernels.config import KernelConfig


def packing_available() -> bool:
    """oneDNN (mkldnn) with the linear-prepack ops is part of this torch build."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


# rows per call the tiled kernel takes: every verify trie, a long match's branch included. Up to 256
# rows it beats PyTorch's product (SmolLM2-135M's forward, one thread: docs/bench/cpu-verify-rows);
# a prompt's longer chunks run faster in PyTorch's
TILED_MAX_ROWS = 256


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] in one of the CPU layouts: "tiled" ([ceil(out / W), in, W], our kernel;
    W = 48 with AVX-512, else 24) or "onednn" (oneDNN's opaque blocked layout)."""

    kind: str
    data: torch.Tensor  # "tiled": float32, or float16 (`pack(half=True)`)
    out_features: int
    kernels: object | None = None  # the compiled CPU kernels' module ("tiled")

    def takes(self, rows: int) -> bool:
        """Whether the packed copy serves `rows` rows: the tiled kernel is for decode and verify
        (<= TILED_MAX_ROWS); a prompt's chunks take PyTorch's product on the unpacked weight, which
        is faster there (docs/bench/cpu-verify-rows)."""
        return self.kernels is None or rows <= TILED_MAX_ROWS

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] -> [rows, out] (+ bias)."""
        if self.kernels is not None:
            bias = x.new_empty(0) if bias is None else bias
            return self.kernels.linear(x, self.data, bias, self.out_features)  # type: ignore[attr-defined]
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")


def tiled_kernels(settings: KernelConfig = KernelConfig()):
    """The compiled CPU kernels' module when the tiled layout applies here, else None: an x86 CPU
    with AVX2 (the kernel's register tiles; elsewhere oneDNN is faster; kernel setting cpu_kernel `on`:
    any processor) whose kernels build, and cpu_kernel not `off`."""
    from tokenswift_trt.kernels import ops as kernels  # lazily, so nothing compiles at import

    if settings.cpu_kernel == "off":
        return None
    if settings.cpu_kernel == "auto" and not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        return None
    status = kernels.load_cpu_kernels()
    return status.module if status.loaded else None


def batch_invariant_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) with a row's bits independent of how many rows come with it: on CUDA through
    `triton_linear` (up to its MAX_ROWS rows; longer inputs, i.e. prefill, keep cuBLAS)."""
    if x.is_cuda:
        from tokenswift_trt.kernels import triton_linear  # Triton ships with CUDA builds of PyTorch only

        if triton_linear.takes(x, weight):
            return triton_linear.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear with an optional prepacked copy of its weight for CPU inference, and on CUDA an
    optional batch-invariant product (`batch_invariant`, set by `LlamaModel.use_batch_invariant`)."""

    batch_invariant = False

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._packed: PackedWeight | None = None
        self._packed_from: tuple[int, int, torch.dtype] | None = None  # weight_identity of the packed weight

    def pack(self, half: bool = False, kernels: KernelConfig = KernelConfig()) -> bool:
        """Prepack the weight for CPU inference; False (nothing changes) where it cannot be done.
        `half`: in float16 where the tiled kernel applies (elsewhere as without it)."""
        self._packed = _prepack(self.weight, half, kernels)
        if self._packed is None:
            return False
        self._packed_from = weight_identity(self.weight)
        return True

    @property
    def packed(self) -> bool:
        """The packed copy exists and still matches the weight."""
        return self._packed is not None and self._packed_from == weight_identity(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if self.batch_invariant and x.is_cuda:
            return batch_invariant_product(x, self.weight, self.bias)
        usable = self._packed is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype
        # torch.compile traces the plain product (the compiler does its own packing and fusion)
        if not usable or not torch.is_inference_mode_enabled() or torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        if not self.packed:  # the weight changed since pack(): never use a stale copy
            self._packed = None
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if not self._packed.takes(rows):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        out = self._packed.product(flat, self.bias)  # [rows, out]
        return out.view(*x.shape[:-1], self.out_features)


def _prepack(
    weight: torch.Tensor, half: bool = False, kernels: KernelConfig = KernelConfig()
) -> PackedWeight | None:
    """A packed copy of a weight [out, in] for CPU inference: tiled for float32 where our kernel
    applies (in float16 with `half`), else oneDNN's layout; None where there is none (not a CPU
    float32/bfloat16 weight, no oneDNN, or e.g. bfloat16 on a CPU without AVX-512 / AVX-NE-CONVERT:
    plain F.linear then)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    with torch.no_grad():
        tiled = tiled_kernels(kernels) if weight.dtype == torch.float32 else None
        if tiled is not None:
            packing = tiled.pack_linear_half if half else tiled.pack_linear
            return PackedWeight("tiled", packing(weight.detach(), kernels.huge_pages), weight.shape[0], tiled)
        if not packing_available():
            return None
        try:
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4)
            return PackedWeight("onednn", onednn, weight.shape[0])
        except RuntimeError:
            return None


def weight_identity(weight: torch.Tensor) -> tuple[int, int, torch.dtype]:
    """What changes when a weight does: the Parameter, its in-place version, its dtype. (Weights
    created under inference mode carry no version; they cannot be changed outside it.)"""
    return id(weight), -1 if weight.is_inference() else weight._version, weight.dtype


def pack_linears(module: nn.Module, half: bool = False, kernels: KernelConfig = KernelConfig()) -> int:
    """Prepack every `Linear` inside `module` (CPU float32/bfloat16; `half`: tiled ones in float16);
    returns how many were packed."""
    return sum(1 for child in module.modules() if isinstance(child, Linear) and child.pack(half, kernels))


class FusedLinears:
    """Linears that read the same input (a layer's Q/K/V projections, an MLP's gate and up) as one
    prepacked product for CPU inference: one kernel call and one pass over the input instead of
    several, each output equal bit for bit to its own Linear's (every output element is the same
    dot product). Not a module: the parts keep their parameters and state-dict keys; this holds a
    packed copy of their concatenated weights, used only while none of them has changed."""

    def __init__(self, parts: Sequence[Linear], packed: PackedWeight, bias: torch.Tensor | None) -> None:
        self.parts = list(parts)
        self.sizes = [part.out_features for part in parts]
        self._packed, self._bias = packed, bias
        self._from = [weight_identity(part.weight) for part in parts]

    @classmethod
    def pack(cls, parts: Sequence[Linear], kernels: KernelConfig = KernelConfig()) -> FusedLinears | None:
        """The fused product of `parts` (same input size, all with or all without bias); None where it
        cannot be packed (not CPU float32/bfloat16, no kernel and no oneDNN). The parts' own packed copies are
        dropped: the fused one replaces them."""
        first = parts[0]
        if (
            any(part.in_features != first.in_features for part in parts)
            or len({part.bias is None for part in parts}) != 1
        ):
            return None
        with torch.no_grad():
            weight = torch.cat([part.weight.detach() for part in parts])  # [sum(out), in]
            packed = _prepack(weight, kernels=kernels)
            bias = None if first.bias is None else torch.cat([part.bias.detach() for part in parts])
        if packed is None:
            return None
        for part in parts:
            part._packed = None
        return cls(parts, packed, bias)

    def usable(self, x: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and torch.is_inference_mode_enabled()
            and not torch.compiler.is_compiling()
            and x.dtype == self.parts[0].weight.dtype
            and all(weight_identity(part.weight) == before for part, before in zip(self.parts, self._from))
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> one output per part [..., part.out] (views of one product)."""
        rows = x.numel() // self.parts[0].in_features
        if not self._packed.takes(rows):
            return tuple(F.linear(x, part.weight, part.bias) for part in self.parts)
        flat = x.reshape(rows, self.parts[0].in_features)
        out = self._packed.product(flat, self._bias)
        return tuple(piece.view(*x.shape[:-1], -1) for piece in out.split(self.sizes, dim=-1))
