"""The target's LM head for sampling on a CPU: read in float16, exact in float32 where sampling looks.

An AR step and a verification read the whole LM head to sample one token per row; on SmolLM2-135M
the head is 49,152 x 576 float32 (113 MB, a fifth of the model's weights). Under the sampling this
project runs (greedy, or min-p: the paper's 0.1 keeps ~20 tokens), almost every token is cut before
the draw. `ScreenedHead` reads a float16 copy of the head instead (half the bytes), bounds how far
each float16 logit can be from the float32 one, and computes again in float32 only the tokens whose
bound reaches the row's cut, with the same kernel and weights as the full head, hence the same
bits; every other token gets a score below anything real (plugins_cuda/cpu/screened_head_cpu.cpp
has the bound and the cut). The sampler then draws exactly the token it draws from the full head,
for AR steps and verifications alike, so TokenSwift's output still equals AR's token for token and
greedy still equals transformers'.

Applies where the tiled CPU kernel computes the head (float32, no bias, <= TILED_MAX_ROWS rows) and
the sampling is greedy or min-p without top-k, top-p or η (those look at every token), with
θ / temperature small enough for the screened score to stay finite; elsewhere the full head runs.
The kernel setting `screened_head=off` switches it off (`LlamaModel.pack`). A head whose weight
changed since packing (training, a new Parameter) is never screened with the stale copy.
"""

from __future__ import annotations

import math

import torch

from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.linear import TILED_MAX_ROWS, Linear, tiled_kernels, weight_identity
from tokenswift_trt.model.sampling import MIN_P_KEEP, SamplingConfig

SCREENED_SCORE = -1.0e30  # what a screened-out token's logit reads (screened_head_cpu.cpp's kScreened)
# the screened score times θ / temperature must stay a finite float32 (the sampler divides by both)
MAX_SCALE = 1.0e6


def screenable(sampling: SamplingConfig) -> bool:
    """Whether `sampling` draws only among the tokens a cut keeps (greedy, or min-p alone)."""
    if sampling.top_k > 0 or sampling.top_p < 1 or sampling.eta > 0:
        return False
    if sampling.greedy:
        return sampling.penalty <= MAX_SCALE
    return sampling.min_p > 0 and sampling.penalty / sampling.temperature <= MAX_SCALE


def error_bounds(weight: torch.Tensor) -> torch.Tensor:
    """weight [V, K] float32 -> [V] float32: per row, ||w - h||_2 + gamma_K (||w||_2 + ||h||_2) with h
    = float16(w) and gamma_K = K u / (1 - K u), u = 2^-24, in float64 and rounded up: times ||x||_2,
    how far the float16 product x · h can be from the float32 one (screened_head_cpu.cpp)."""
    w = weight.detach().double()
    h = weight.detach().half().double()
    depth = weight.shape[1]
    gamma = depth * 2.0**-24 / (1 - depth * 2.0**-24)
    bounds = (w - h).norm(dim=1) + gamma * (w.norm(dim=1) + h.norm(dim=1))
    return (bounds * (1 + 1e-6) + 1e-12).float()


class ScreenedHead:
    """A float16 copy of a bias-free float32 LM head and its error bounds (`error_bounds`)."""

    def __init__(self, head: Linear, kernels, huge_pages: bool = True) -> None:
        self.head, self.kernels = head, kernels
        self.weight = head.weight.detach()  # [V, K]: the head's own storage (`applies` checks it)
        with torch.no_grad():
            self.half = kernels.pack_linear_half(self.weight, huge_pages)
            self.bounds = error_bounds(self.weight)
        self._from = weight_identity(head.weight)

    @classmethod
    def of(cls, head: Linear, settings: KernelConfig = KernelConfig()) -> ScreenedHead | None:
        """For a bias-free CPU float32 head packed for the tiled kernel (whose float32 product the exact
        logits must equal bit for bit); None elsewhere."""
        weight = head.weight
        if head.bias is not None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        if not weight.is_contiguous():  # the kernel gathers rows of [V, K] in place
            return None
        if not head.packed or head._packed is None or head._packed.kind != "tiled":
            return None
        kernels = tiled_kernels(settings)
        if kernels is None or not hasattr(kernels, "screened_logits"):
            return None
        return cls(head, kernels, settings.huge_pages)

    def applies(self, rows: int, sampling: SamplingConfig) -> bool:
        return (
            0 < rows <= TILED_MAX_ROWS
            and screenable(sampling)
            and torch.is_inference_mode_enabled()
            and weight_identity(self.head.weight) == self._from
        )

    def logits(self, x: torch.Tensor, sampling: SamplingConfig, windows: torch.Tensor) -> torch.Tensor:
        """x [R, K] (after the final norm), windows [W] or [R, W] token ids (the penalty's, as the
        sampler takes them) -> [R, V]: the head's float32 logits wherever sampling could keep a token,
        SCREENED_SCORE elsewhere."""
        rows = windows[None] if windows.dim() == 1 else windows  # the kernel ignores them when θ = 1
        return self.kernels.screened_logits(
            x.contiguous(),
            self.half,
            self.bounds,
            self.weight,
            rows.contiguous(),
            sampling.penalty,
            sampling.greedy,
            sampling.temperature,
            math.log(sampling.min_p) if not sampling.greedy else 0.0,
            MIN_P_KEEP,
        )
