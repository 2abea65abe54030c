"""Logits processing and position-keyed sampling, shared by AR decoding and TokenSwift verification.

Processing of one distribution, in order: contextual penalty over the last W tokens of the
context (positive logits / θ, negative × θ), then temperature, then the truncations that are set
(top-k, top-p, min-p, η). Temperature 0 means greedy: argmax of the penalised logits.

Randomness is keyed by absolute position: the uniform number that samples the token at position
p is a pure function of (seed, p), drawn by inverse CDF over the processed distribution in token
id order. AR decoding and every trie node at position p use the same number, so with one seed
both emit the same tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

import torch

MIN_P_KEEP = 20  # min-p keeps at least this many tokens
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    eta: float = 0.0  # 0 = off
    penalty: float = 1.0  # θ; 1 = off
    penalty_window: int = 1024  # W

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise ValueError naming the bad value and its valid range."""
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min-p must be in [0, 1), got {self.min_p}")
        if not 0 <= self.eta < 1:
            raise ValueError(f"eta must be in [0, 1), got {self.eta}")
        if not self.penalty >= 1:
            raise ValueError(f"penalty must be >= 1 (1 = off), got {self.penalty}")
        if self.penalty_window < 0:
            raise ValueError(f"penalty window must be >= 0, got {self.penalty_window}")


def apply_penalty(logits: torch.Tensor, window: torch.Tensor, theta: float) -> torch.Tensor:
    """logits [..., V], window [W] token ids -> logits with every token in the window penalised once
    (the same window for every row)."""
    if theta == 1 or window.numel() == 0:
        return logits
    index = window.expand(*logits.shape[:-1], window.numel())
    picked = logits.gather(-1, index)
    penalised = torch.where(picked > 0, picked / theta, picked * theta)
    return logits.scatter(-1, index, penalised)


def top_k_filter(scores: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = scores.topk(k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose mass reaches top_p (at least one)."""
    if top_p >= 1:
        return scores
    sorted_scores, order = scores.sort(dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def min_p_filter(scores: torch.Tensor, min_p: float, keep: int = MIN_P_KEEP) -> torch.Tensor:
    """Keep tokens with p >= min_p * p_max, and never fewer than `keep` of the most probable."""
    if min_p <= 0:
        return scores
    probs = scores.softmax(dim=-1)
    remove = probs < min_p * probs.max(dim=-1, keepdim=True).values
    protected = probs.topk(min(keep, probs.shape[-1]), dim=-1).indices
    remove = remove.scatter(-1, protected, False)
    return scores.masked_fill(remove, float("-inf"))


def eta_filter(scores: torch.Tensor, eta: float) -> torch.Tensor:
    """η-sampling: drop tokens with p < min(η, sqrt(η)·exp(-entropy)), keeping the most probable."""
    if eta <= 0:
        return scores
    if scores.dim() > 1:
        return torch.stack([eta_filter(row, eta) for row in scores])
    log_probs = scores.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = float(-(probs * log_probs.nan_to_num(neginf=0.0)).sum())
    threshold = min(eta, eta**0.5 * math.exp(-entropy))
    remove = probs < threshold
    remove[probs.argmax()] = False
    return scores.masked_fill(remove, float("-inf"))


def process_logits(logits: torch.Tensor, window: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """logits [..., V], window [≤W] -> processed scores [..., V] (-inf = excluded), every row with the
    same window. Greedy: penalised logits."""
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scores = apply_penalty(scores, window, config.penalty)
    if config.greedy:
        return scores
    scores = scores / config.temperature
    scores = top_k_filter(scores, config.top_k)
    scores = top_p_filter(scores, config.top_p)
    scores = min_p_filter(scores, config.min_p)
    return eta_filter(scores, config.eta)


def inverse_cdf_sample(scores: torch.Tensor, uniform: float) -> int:
    """Token whose CDF interval (token id order, float64) contains `uniform` * total mass.

    Computed on the scores' device with a single read of the result (one host sync on a GPU).
    """
    probs = torch.softmax(scores.to(torch.float64), dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = cdf[-1:] * uniform  # [1]
    found = torch.searchsorted(cdf, target, right=True)  # [1]
    index = found.clamp(max=probs.numel() - 1)
    has_mass = probs > 0
    last_with_mass = probs.numel() - 1 - has_mass.flip(0).to(torch.int8).argmax()  # u at the very top
    beyond = (found >= probs.numel()) | ~has_mass[index]
    return int(torch.where(beyond, last_with_mass, index))


def choose_token(scores: torch.Tensor, config: SamplingConfig, uniform: float) -> int:
    """processed scores [V] -> token id (argmax when greedy, else inverse CDF at `uniform`)."""
    if config.greedy:
        return int(scores.argmax())
    return inverse_cdf_sample(scores, uniform)


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def position_uniform(seed: int, position: int) -> float:
    """Uniform in [0, 1) as a pure function of (seed, position)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 11) * 2.0**-53


class RandomSource(Protocol):
    def uniform(self, position: int) -> float: ...


@dataclass(frozen=True)
class PositionKeyedRandom:
    """The default: the same (seed, position) always gives the same number."""

    seed: int

    def uniform(self, position: int) -> float:
        return position_uniform(self.seed, position)


class IndependentRandom:
    """A fresh number on every call (for statistical tests of acceptance rules)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def uniform(self, position: int) -> float:
        return self._rng.random()
