"""Rotary position embedding tables: default, linear, llama3 and yarn scaling.

Inverse frequencies follow the published formulas (and Hugging Face's implementation of them),
computed in float32 so that logits agree with transformers' models to fp32 round-off.
"""

from __future__ import annotations

import math

import torch

from tokenswift_trt.model.config import ModelConfig


def _base_inv_freq(theta: float, dim: int, device: torch.device) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    return 1.0 / (theta**exponents)  # [dim / 2]


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor = float(rope["factor"])
    low_freq_factor = float(rope["low_freq_factor"])
    high_freq_factor = float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    theta: float, dim: int, rope: dict, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, float]:
    original = float(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_positions / original

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1
    )
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables for explicit position ids (tree nodes use position = root position + depth)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        dim = int(config.head_dim * float(config.rope.get("partial_rotary_factor", 1.0)))
        if dim != config.head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        kind = config.rope_type
        self.attention_factor = 1.0
        if kind == "default":
            inv_freq = _base_inv_freq(config.rope_theta, dim, device)
        elif kind == "linear":
            inv_freq = _base_inv_freq(config.rope_theta, dim, device) / float(config.rope["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(_base_inv_freq(config.rope_theta, dim, device), config.rope)
        elif kind == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(
                config.rope_theta, dim, config.rope, config.max_position_embeddings, device
            )
        else:
            raise ValueError(f"unsupported rope type {kind!r}")
        self.inv_freq = inv_freq  # [head_dim / 2] float32

    def to(self, device: torch.device | str) -> RotaryEmbedding:
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, head_dim] in `dtype`."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.attention_factor
        sin = angles.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
