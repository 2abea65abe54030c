"""Tree masks packed as bits: the form every tree-attention kernel reads ([T, ceil(T / 32)] int32,
bit j % 32 of word j // 32 set when node j is visible)."""

from __future__ import annotations

import torch


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """mask [T, T] bool -> [T, ceil(T / 32)] int32 words (bit j % 32 of word j // 32 = node j visible)."""
    count = mask.shape[-1]
    words = (count + 31) // 32
    padded = torch.zeros(mask.shape[0], words * 32, dtype=torch.int64, device=mask.device)
    padded[:, :count] = mask.to(torch.int64)
    weights = torch.pow(2, torch.arange(32, dtype=torch.int64, device=mask.device))  # [32]
    unsigned = (padded.view(mask.shape[0], words, 32) * weights).sum(dim=-1)  # [T, words], 0 .. 2^32 - 1
    signed = unsigned - (unsigned >= 2**31).to(torch.int64) * 2**32  # same 32 bits as int32
    return signed.to(torch.int32)


def unpack_tree_mask(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[T, words] int32 -> [T, count] bool (inverse of `pack_tree_mask`)."""
    bits = torch.arange(32, dtype=torch.int64, device=packed.device)
    unsigned = packed.to(torch.int64) & 0xFFFFFFFF  # [T, words]
    expanded = (unsigned[:, :, None] >> bits) & 1  # [T, words, 32]
    return expanded.reshape(packed.shape[0], -1)[:, :count].bool()
