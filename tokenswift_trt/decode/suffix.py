"""Long matches: the longest earlier occurrence of the text's current suffix proposes what followed it.

Long generations repeat themselves (a refrain, a list, a quoted passage, code). Where they do, the
paper's 4-grams propose at most three tokens past the root, while the earlier occurrence knows many
more: SuffixDecoding (arXiv 2411.04975) drafts the continuation of the longest matching suffix, as deep
as it goes. This index does the same over the prompt and the committed text.

Matching is by keys of a few lengths (`KEY_LENGTHS`; 4-grams are the n-gram table's): for each
length k, the last end position of every k-token window seen so far. A lookup tries the longest k
first; the most recent earlier window equal to the history's last k tokens gives the continuation.
Appending a token costs one dict write per key length; a lookup at most one dict read per key length.
Only windows whose continuation is already known are indexed, so a match never points at the
current position itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

KEY_LENGTHS = (32, 16, 8)  # longest first: a longer match predicts its continuation better
MAX_DEPTH = 32  # tokens proposed past the root at most


@dataclass
class SuffixIndex:
    """Last end position of every window of `key_lengths` tokens in `tokens` (the prompt, then every
    committed token, the root included as soon as it is committed)."""

    key_lengths: tuple[int, ...] = KEY_LENGTHS
    tokens: list[int] = field(default_factory=list)
    _ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    _indexed: int = 0  # windows ending at positions < _indexed are in `_ends`

    def __post_init__(self) -> None:
        if not self.key_lengths or min(self.key_lengths) < 1:
            raise ValueError(f"key lengths must be positive, got {self.key_lengths}")
        self.key_lengths = tuple(sorted(set(self.key_lengths), reverse=True))
        self._ends = {k: {} for k in self.key_lengths}

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens; index every window whose next token is now known."""
        self.tokens.extend(new_tokens)
        last = len(self.tokens) - 1  # a window ending here has no continuation yet
        tokens = self.tokens
        for end in range(self._indexed, last):
            for k, ends in self._ends.items():
                if end + 1 >= k:
                    ends[tuple(tokens[end + 1 - k : end + 1])] = end + 1  # exclusive end
        self._indexed = max(self._indexed, last)

    def match(self, history: Sequence[int] | None = None) -> tuple[int, int]:
        """(length, end) of the longest key matching the end of `history` (default: the indexed
        tokens) at its most recent earlier occurrence; (0, -1) when none matches."""
        history = self.tokens if history is None else history
        for k in self.key_lengths:
            if len(history) < k:
                continue
            end = self._ends[k].get(tuple(history[len(history) - k :]))
            if end is not None:
                return k, end
        return 0, -1

    def continuation(self, history: Sequence[int] | None = None, depth: int = MAX_DEPTH) -> list[int]:
        """`depth` tokens that followed the longest earlier match of `history`'s suffix (default: the
        indexed tokens); [] when nothing matches. `history` may run past the indexed tokens by
        uncommitted ones (the root of an iteration)."""
        history = self.tokens if history is None else history
        length, end = self.match(history)
        return following(history, end, depth) if length else []


def following(history: Sequence[int], end: int, depth: int) -> list[int]:
    """The `depth` tokens after an earlier occurrence ending at `end`; where it runs into the present (a
    text repeating with period p = len(history) - end), the continuation repeats that period."""
    period = len(history) - end
    return [history[end + i % period] for i in range(max(depth, 0))]


def match_tensors(
    history: torch.Tensor,  # [C] committed ids (the root last), then anything
    count: torch.Tensor,  # 0-d: committed ids
    remaining: torch.Tensor,  # 0-d: tokens left before the limit
    key_lengths: tuple[int, ...] = KEY_LENGTHS,
    min_match: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The long match's branch on the device with no read back: `SuffixIndex.match` and `following`
    over the history tensor, as `stages.retrieve_suffix` offers it (a match of at least `min_match`
    tokens; as deep as it matched, at most `remaining` - 1). Returns tokens [MAX_DEPTH] and valid
    [MAX_DEPTH] (a prefix: the branch's depth)."""
    device = history.device
    found = torch.zeros((), dtype=torch.bool, device=device)
    end = torch.zeros((), dtype=torch.long, device=device)
    length = torch.zeros((), dtype=torch.long, device=device)
    for k in sorted(set(key_lengths), reverse=True):  # longest first: the first found wins
        if k < min_match or history.numel() < k:
            continue
        key = history[(count - k + torch.arange(k, device=device)).clamp(min=0)]  # [k]
        windows = history.unfold(0, k, 1)  # [C - k + 1, k]: window j covers j .. j + k - 1
        ends = torch.arange(k, history.numel() + 1, device=device)  # [C - k + 1] exclusive ends
        # indexed windows: their next id is committed (end <= count - 1); the latest one wins
        hit = (windows == key).all(dim=1) & (ends <= count - 1) & (count >= k)
        best = torch.where(hit, ends, -1).max()
        take = ~found & (best > 0)
        end, length = torch.where(take, best, end), torch.where(take, k, length)
        found = found | take
    depth = torch.minimum(length, remaining - 1)
    steps = torch.arange(MAX_DEPTH, device=device)
    period = (count - end).clamp(min=1)
    tokens = history[(end + steps % period).clamp(max=history.numel() - 1)]  # [MAX_DEPTH]
    return tokens, found & (steps < depth)


# Between AR steps (`--tree auto` settled on them) the loop looks for a long match every
# `LOOKUP_EVERY` steps and verifies its branch when one is found, while that pays
LOOKUP_EVERY = 8
BACKOFF_TOKENS = (32, 4096)  # a branch that did not pay: no lookups for this many tokens, doubling to the cap


@dataclass
class MatchGate:
    """Whether a long match's branch is verified between AR steps: measured, like the tuner's plans.
    A branch iteration that commits its tokens slower than AR steps do (per token) closes the gate
    for `backoff` tokens, doubling after each loss in a row; one that pays resets the backoff."""

    ar_s_per_token: float | None = None  # the last AR run's
    closed_until: int = 0  # new-token count before which no lookup is made
    backoff: int = BACKOFF_TOKENS[0]
    wins: int = 0
    losses: int = 0

    def open(self, position: int) -> bool:
        return position >= self.closed_until

    def ar_run(self, seconds: float, steps: int) -> None:
        if steps:
            self.ar_s_per_token = seconds / steps

    def branch_run(self, position: int, seconds: float, tokens: int) -> None:
        """A branch iteration committed `tokens` from `position` on in `seconds`."""
        if self.ar_s_per_token is None or seconds / tokens <= self.ar_s_per_token:
            self.wins, self.backoff = self.wins + 1, BACKOFF_TOKENS[0]
            return
        self.losses += 1
        self.closed_until = position + tokens + self.backoff
        self.backoff = min(2 * self.backoff, BACKOFF_TOKENS[1])
