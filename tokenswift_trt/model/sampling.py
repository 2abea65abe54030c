"""Logits processing and position-keyed sampling, shared by AR decoding and TokenSwift verification.

Processing of one distribution, in order: contextual penalty over the last W tokens of the
context (positive logits / θ, negative × θ), then temperature, then the truncations that are set
(top-k, top-p, min-p, η). Temperature 0 means greedy: argmax of the penalised logits.

Randomness is keyed by absolute position: the token at position p is the Gumbel-max sample
argmax(scores + g_p), where the noise g_p [V] is a pure function of (seed, p) (a counter-based
hash whose uniforms are bit-identical on every device). AR decoding and every trie node at
position p use the same noise, so with one seed both emit the same tokens. Drafts may use it
too (`draft_ranking`): knowing the noise, a draft whose distribution is close to the target's
predicts the target's token almost surely, whatever its entropy, without changing what is
sampled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.kernels.transfer import to_device

MIN_P_KEEP = 20  # min-p keeps at least this many tokens
# beyond these the distribution is uniform over the vocabulary (or the penalty excludes a token) to
# float precision: a larger value is a typo, not a setting
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 1e6
FUSED_MAX_WIDTH = 64  # widest ranking the compiled sampler returns (plugins_cuda/cpu/sampling_cpu.cpp)
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
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min-p must be in [0, 1), got {self.min_p}")
        if not 0 <= self.eta < 1:
            raise ValueError(f"eta must be in [0, 1), got {self.eta}")
        if not 1 <= self.penalty <= MAX_PENALTY:
            raise ValueError(f"penalty must be in [1, {MAX_PENALTY:g}] (1 = off), got {self.penalty}")
        if self.penalty_window < 0:
            raise ValueError(f"penalty window must be >= 0, got {self.penalty_window}")


def apply_penalty(logits: torch.Tensor, window: torch.Tensor, theta: float) -> torch.Tensor:
    """logits [..., V], window [W] token ids (the same for every row) or [..., W] (one per row) ->
    logits with every token in the row's window penalised once."""
    if theta == 1 or window.numel() == 0:
        return logits
    index = window if window.dim() > 1 else window.expand(*logits.shape[:-1], window.numel())
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
    remove_sorted[..., -1].fill_(False)  # a fill, not a copy of a host value (CUDA graph capture)
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def min_p_filter(scores: torch.Tensor, min_p: float, keep: int = MIN_P_KEEP) -> torch.Tensor:
    """Keep tokens with p >= min_p * p_max, and never fewer than `keep` of the most probable.

    p_i / p_max = exp(s_i - s_max), so the test runs on the scores themselves (s_i >= s_max +
    log min_p): no softmax over the vocabulary.
    """
    if min_p <= 0:
        return scores
    top = scores.topk(min(keep, scores.shape[-1]), dim=-1)  # its first value is the row's maximum
    remove = scores < top.values[..., :1] + math.log(min_p)
    remove.scatter_(-1, top.indices, False)
    return scores.masked_fill(remove, float("-inf"))


def eta_filter(scores: torch.Tensor, eta: float) -> torch.Tensor:
    """η-sampling: drop tokens with p < min(η, sqrt(η)·exp(-entropy)), keeping the most probable;
    scores [..., V], each row on its own entropy. Tensor operations only: nothing is read back, so a
    CUDA graph can hold it."""
    if eta <= 0:
        return scores
    log_probs = scores.log_softmax(dim=-1)  # [..., V]
    probs = log_probs.exp()
    entropy = -(probs * log_probs.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)  # [..., 1]
    threshold = (eta**0.5 * torch.exp(-entropy)).clamp(max=eta)  # [..., 1]
    remove = (probs < threshold).scatter(-1, probs.argmax(-1, keepdim=True), False)
    return scores.masked_fill(remove, float("-inf"))


def process_logits(logits: torch.Tensor, window: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """logits [..., V], window [≤W] (every row) or [..., ≤W] (per row) -> processed scores [..., V]
    (-inf = excluded). Greedy: penalised logits."""
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scores = apply_penalty(scores, window, config.penalty)
    if config.greedy:
        return scores
    if config.temperature != 1:  # x / 1 == x: one tensor operation (a launch on a GPU) saved
        scores = scores / config.temperature
    scores = top_k_filter(scores, config.top_k)
    scores = top_p_filter(scores, config.top_p)
    scores = min_p_filter(scores, config.min_p)
    return eta_filter(scores, config.eta)


def gumbel_max_sample(scores: torch.Tensor, noise: torch.Tensor) -> int:
    """processed scores [V] + Gumbel noise [V] -> argmax token id (one read of the result).

    With independent standard Gumbel noise this is an exact sample of softmax(scores); tokens
    excluded by the transforms (-inf) are never chosen.
    """
    return int(torch.argmax(scores.to(torch.float64) + noise))


def gumbel_max_rows(scores: torch.Tensor, noise: torch.Tensor) -> list[int]:
    """`gumbel_max_sample` for every row: scores [N, V] + noise [N, V] -> N token ids (one read)."""
    return torch.argmax(scores.to(torch.float64) + noise, dim=-1).tolist()


def choose_token(scores: torch.Tensor, config: SamplingConfig, random: RandomSource, position: int) -> int:
    """processed scores [V] -> the token for `position` (argmax when greedy, else Gumbel-max with
    that position's noise)."""
    if config.greedy:
        return int(scores.argmax())
    return gumbel_max_sample(scores, random.gumbel(position, scores.shape[-1], scores.device))


def draft_ranking(scores: torch.Tensor, noises: torch.Tensor | None, width: int) -> torch.Tensor:
    """Draft scores [D, V] (processed like the target's) -> [D, width] candidate ids, best first.

    With the noise of the positions they draft ([D, V]; None when greedy), rank 0 is the token the
    target will draw there if its distribution equals the draft's, and the next ranks follow in
    perturbed order (a draw without replacement from the draft's distribution). The closer the
    draft is to the target, the likelier its rank-0 token is the target's.
    """
    perturbed = scores.to(torch.float64)
    if noises is not None:
        perturbed = perturbed + noises
    return perturbed.topk(min(width, scores.shape[-1]), dim=-1).indices


@dataclass(frozen=True)
class NoiseKeys:
    """The noise of some positions, not yet computed: what `PositionKeyedRandom.keys` returns for a
    sampler that computes noise itself (`FusedSampler` under min-p, where only the few tokens min-p
    keeps need theirs). `rows` gives the same values as `PositionKeyedRandom.gumbel_rows`."""

    seed: int
    positions: tuple[int, ...]

    def keys(self) -> torch.Tensor:
        """[P] int64: the key of (seed, p) for every position, as `position_gumbel_tensor` hashes it."""
        seed_key = _splitmix64(self.seed & _MASK64)
        return torch.tensor([_signed(_splitmix64(p ^ seed_key)) for p in self.positions], dtype=torch.int64)

    def rows(self, size: int, device: torch.device) -> torch.Tensor:
        """[P, size] float64: the noise itself."""
        index = torch.arange(size, dtype=torch.int64, device=device)
        return position_gumbel_rows(self.seed, self.positions, index)


Noise = torch.Tensor | NoiseKeys | None  # rows [N, V] float64, keys of N positions, or none (greedy)


def noise_rows(noise: Noise, size: int, device: torch.device) -> torch.Tensor | None:
    """Noise as rows [N, size] float64 (keys computed here), or None."""
    return noise.rows(size, device) if isinstance(noise, NoiseKeys) else noise


@dataclass(frozen=True)
class TorchSampler:
    """The sampling step in PyTorch tensor operations, on any device: `process_logits`, then the
    Gumbel-max sample (argmax when greedy) of each row, or a draft's ranking (`draft_ranking`)."""

    config: SamplingConfig
    takes_keys = False  # noise comes as rows

    def rank(self, logits: torch.Tensor, window: torch.Tensor, noise: Noise, width: int) -> torch.Tensor:
        """logits [N, V], window [W] (every row) or [N, W], noise [N, V] float64 (or its keys) or None
        (greedy, or noise unknown to a draft) -> [N, width] int64 token ids, best first."""
        rows = noise_rows(noise, logits.shape[-1], logits.device)
        return draft_ranking(process_logits(logits, window, self.config), rows, width)

    def samples(self, logits: torch.Tensor, window: torch.Tensor, noise: Noise) -> list[int]:
        """One token per row (None noise only when greedy)."""
        return self.sample_rows(logits, window, noise).tolist()

    def sample_rows(self, logits: torch.Tensor, window: torch.Tensor, noise: Noise) -> torch.Tensor:
        """`samples` left on the device: [N] int64 (nothing read back, so a CUDA graph can hold it)."""
        scores = process_logits(logits, window, self.config)  # [N, V]
        if self.config.greedy:
            return scores.argmax(dim=-1)
        rows = noise_rows(noise, logits.shape[-1], logits.device)
        assert rows is not None, "sampling needs noise"
        return torch.argmax(scores.to(torch.float64) + rows, dim=-1)


@dataclass(frozen=True)
class FusedSampler:
    """`TorchSampler`'s step in one compiled call per batch of rows: plugins_cuda/cpu/sampling_cpu.cpp, for
    float32 logits on a CPU.
    There the dozen tensor operations of the PyTorch path cost more in dispatch than in arithmetic;
    AR steps and TokenSwift iterations both sample through it, so with one seed they emit the same
    tokens. Top-k, top-p and η are not in the kernel: `fused_sampler` returns None
    for configs that set them."""

    run: Callable[..., torch.Tensor]  # the extension's gumbel_topk
    config: SamplingConfig

    @property
    def takes_keys(self) -> bool:
        """Whether noise may come as keys (`NoiseKeys`): under min-p, where the kernel computes the
        noise of the few tokens min-p keeps instead of reading a row of V (without min-p every token
        needs its noise, which tensor operations compute faster)."""
        return self.config.min_p > 0 and not self.config.greedy

    def rank(self, logits: torch.Tensor, window: torch.Tensor, noise: Noise, width: int) -> torch.Tensor:
        """logits [N, V] float32, window [W] (every row) or [N, W], noise [N, V] float64 (or its keys)
        or None (greedy, or noise unknown to a draft) -> [N, width] int64 token ids, best first."""
        config = self.config
        if (
            width > FUSED_MAX_WIDTH
        ):  # the kernel keeps a fixed-size ranking: wider trees take the PyTorch path
            return TorchSampler(config).rank(logits, window, noise, width)
        windows = window[None] if window.dim() == 1 else window
        min_p = self.takes_keys  # min-p truncates: the kernel computes noise only for what it keeps
        keep = MIN_P_KEEP if min_p else 0
        if noise is None:
            noise_input = logits.new_empty(0, dtype=torch.float64)
        elif isinstance(noise, NoiseKeys):
            noise_input = noise.keys() if min_p else noise.rows(logits.shape[-1], logits.device)
        else:
            noise_input = noise.contiguous()
        return self.run(
            logits.contiguous(),
            windows.contiguous(),
            noise_input,
            config.penalty,
            config.greedy,
            config.temperature,
            math.log(config.min_p) if min_p else 0.0,
            keep,
            width,
        )

    def samples(self, logits: torch.Tensor, window: torch.Tensor, noise: Noise) -> list[int]:
        """One token per row (None noise only when greedy)."""
        return self.sample_rows(logits, window, noise).tolist()

    def sample_rows(self, logits: torch.Tensor, window: torch.Tensor, noise: Noise) -> torch.Tensor:
        """`samples` as a tensor: [N] int64."""
        return self.rank(logits, window, noise, 1)[:, 0]


Sampler = TorchSampler | FusedSampler


def fused_sampler(
    config: SamplingConfig, device: torch.device, dtype: torch.dtype, settings: KernelConfig = KernelConfig()
) -> FusedSampler | None:
    """The compiled sampler for float32 logits on a CPU (built with the CPU kernels on first use), or
    None where the PyTorch path runs: another device or dtype, top-k / top-p / η set, the CPU kernels
    switched off (kernel setting cpu_kernel=off) or not buildable here."""
    if device.type != "cpu" or dtype != torch.float32 or settings.cpu_kernel == "off":
        return None
    if config.top_k > 0 or config.top_p < 1 or config.eta > 0:
        return None
    status = kernels.load_cpu_kernels()
    if not status.loaded:
        return None
    return FusedSampler(status.module.gumbel_topk, config)  # type: ignore[union-attr]


_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_C1 = 0xBF58476D1CE4E5B9
_SPLITMIX_C2 = 0x94D049BB133111EB


def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_C1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_C2) & _MASK64
    return value ^ (value >> 31)


def _signed(value: int) -> int:
    """uint64 -> the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """_splitmix64 on int64 tensors (two's-complement wrap-around = arithmetic mod 2**64)."""
    x = x + _signed(_SPLITMIX_GAMMA)
    x = (x ^ _shift_right(x, 30)) * _signed(_SPLITMIX_C1)
    x = (x ^ _shift_right(x, 27)) * _signed(_SPLITMIX_C2)
    return x ^ _shift_right(x, 31)


def keyed_uniforms(key: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[size] float64 in (0, 1): element i is a pure function of (key, i), the same on every device."""
    keys = torch.tensor([_signed(key & _MASK64)], dtype=torch.int64, device=device)
    return keyed_uniform_rows(keys, torch.arange(size, dtype=torch.int64, device=device))[0]


def keyed_uniform_rows(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """keys [P] int64, index [V] int64 -> [P, V] float64 in (0, 1): `keyed_uniforms(key, V)` of
    every key in one batch of tensor operations."""
    bits = _splitmix64_tensor(index[None, :] ^ keys[:, None])
    return (_shift_right(bits, 11).to(torch.float64) + 0.5) * 2.0**-53


def position_gumbel(seed: int, position: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise [size] float64 for sampling `position`: a pure function of (seed, position)."""
    return position_gumbel_rows(seed, [position], torch.arange(size, dtype=torch.int64, device=device))[0]


def position_gumbel_rows(seed: int, positions: Sequence[int], index: torch.Tensor) -> torch.Tensor:
    """`position_gumbel` of several positions in one batch: [len(positions), V] on index's device,
    index = arange(V) int64 (callers keep it)."""
    return position_gumbel_tensor(seed, to_device(list(positions), torch.int64, index.device), index)


def position_gumbel_tensor(seed: int, positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`position_gumbel_rows` with the positions [P] int64 already on the device (nothing read back):
    [P, V] float64, bit-identical to the host-keyed rows."""
    seed_key = _signed(_splitmix64(seed & _MASK64))
    keys = _splitmix64_tensor(positions ^ seed_key)  # the key of (seed, p) for every position p
    return -torch.log(-torch.log(keyed_uniform_rows(keys, index)))


class RandomSource(Protocol):
    # True when gumbel(p) is fixed before it is drawn, so drafts may rank with it (draft_ranking)
    noise_known_in_advance: bool

    def gumbel(self, position: int, size: int, device: torch.device) -> torch.Tensor:
        """Standard Gumbel noise [size] float64 on `device` for sampling the token at `position`."""
        ...

    def gumbel_rows(self, positions: Sequence[int], size: int, device: torch.device) -> torch.Tensor:
        """[len(positions), size]: `gumbel` of each position, in order."""
        ...

    def keys(self, positions: Sequence[int]) -> NoiseKeys | None:
        """The noise of those positions as keys a sampler computes it from, or None where the noise
        is not a function of the position."""
        ...


class PositionKeyedRandom:
    """The default: the same (seed, position) always gives the same noise (recent ones memoised).
    Positions not in the memo are computed in one batch (one set of tensor operations: on a GPU,
    one set of kernel launches however many positions), together with the LOOKAHEAD positions
    after the last one asked for: decoding asks for the next few positions every iteration, so
    the hash runs about once every LOOKAHEAD / (tokens per iteration) iterations. Noise is a pure
    function of (seed, position), so computing it early changes nothing that is sampled."""

    MEMO = 64  # rows kept: [V] float64 each (1 MiB for a 128K vocabulary)
    LOOKAHEAD = 16
    noise_known_in_advance = True

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._memo: dict[tuple[int, int, str], torch.Tensor] = {}
        self._index: dict[tuple[int, str], torch.Tensor] = {}  # arange(size) per (size, device)

    def gumbel(self, position: int, size: int, device: torch.device) -> torch.Tensor:
        return self.gumbel_rows([position], size, device)[0]

    def keys(self, positions: Sequence[int]) -> NoiseKeys:
        return NoiseKeys(self.seed, tuple(positions))

    def gumbel_rows(self, positions: Sequence[int], size: int, device: torch.device) -> torch.Tensor:
        where = str(device)
        missing = [p for p in dict.fromkeys(positions) if (p, size, where) not in self._memo]
        if missing:
            ahead = range(max(positions) + 1, max(positions) + 1 + self.LOOKAHEAD)
            missing += [p for p in ahead if (p, size, where) not in self._memo]
            if len(self._memo) + len(missing) > self.MEMO:
                # positions before the earliest one asked for are behind the decoder: drop them first
                oldest = min(positions)
                self._memo = {key: row for key, row in self._memo.items() if key[0] >= oldest}
                if len(self._memo) + len(missing) > self.MEMO:
                    self._memo.clear()
                    wanted = list(dict.fromkeys(positions)) + list(ahead)
                    missing = wanted[: max(self.MEMO, len(dict.fromkeys(positions)))]
            index = self._index.get((size, where))
            if index is None:
                index = self._index[(size, where)] = torch.arange(size, dtype=torch.int64, device=device)
            for position, row in zip(missing, position_gumbel_rows(self.seed, missing, index)):
                self._memo[(position, size, where)] = row
        rows = [self._memo[(p, size, where)] for p in positions]
        return rows[0][None] if len(rows) == 1 else torch.stack(rows)


class IndependentRandom:
    """Fresh noise on every call (for statistical tests of acceptance rules); drafts cannot know it,
    so they rank by probability."""

    noise_known_in_advance = False

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def gumbel(self, position: int, size: int, device: torch.device) -> torch.Tensor:
        uniform = torch.rand(size, generator=self._generator, dtype=torch.float64).clamp_(min=2.0**-60)
        return (-torch.log(-torch.log(uniform))).to(device)

    def gumbel_rows(self, positions: Sequence[int], size: int, device: torch.device) -> torch.Tensor:
        return torch.stack([self.gumbel(p, size, device) for p in positions])

    def keys(self, positions: Sequence[int]) -> None:
        return None
