"""Long matches: the longest earlier occurrence of the text's current suffix proposes what followed it.

Long generations repeat themselves (a refrain, a list, a quoted passage, code). Where they do, the
paper's 4-grams propose at most three tokens past the root, while the earlier occurrence knows many
more: SuffixDecoding (arXiv 2411.04975) drafts the continuation of the longest matching suffix, as deep
as it goes. This index does the same over the prompt and the committed text.

Matching is by keys of a few lengths (`KEY_LENGTHS`; 4-grams are the n-gram table's): for each
length k, the last two end positions of every k-token window seen so far. A lookup tries the longest
k first; the most recent earlier window equal to the history's last k tokens gives the continuation.
Appending a token costs one dict write per key length; a lookup at most two dict reads per key length.
Only windows whose continuation is already known are indexed, so a match never points at the
current position itself.

Where no key matches, a *substituted match* is tried: the history without its last token matches an
earlier window whose next token `a` differs from the last token `b` (a schedule whose hour changes on
every line, a numbered list, a template with a new name). Its continuation is what followed `a`, with
every `a` in it written as `b`: `- 2:00pm-2:30pm` followed by `- 3` proposes `:00pm-3:30pm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

KEY_LENGTHS = (32, 16, 8)  # longest first: a longer match predicts its continuation better
MAX_DEPTH = 32  # tokens proposed past the root at most


@dataclass
class SuffixIndex:
    """Last two end positions of every window of `key_lengths` tokens in `tokens` (the prompt, then
    every committed token, the root included as soon as it is committed)."""

    key_lengths: tuple[int, ...] = KEY_LENGTHS
    tokens: list[int] = field(default_factory=list)
    _ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    _before: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)  # the end before that
    _indexed: int = 0  # windows ending at positions < _indexed are in `_ends`

    def __post_init__(self) -> None:
        if not self.key_lengths or min(self.key_lengths) < 1:
            raise ValueError(f"key lengths must be positive, got {self.key_lengths}")
        self.key_lengths = tuple(sorted(set(self.key_lengths), reverse=True))
        self._ends = {k: {} for k in self.key_lengths}
        self._before = {k: {} for k in self.key_lengths}

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens; index every window whose next token is now known."""
        self.tokens.extend(new_tokens)
        last = len(self.tokens) - 1  # a window ending here has no continuation yet
        tokens = self.tokens
        for end in range(self._indexed, last):
            for k, ends in self._ends.items():
                if end + 1 >= k:
                    key = tuple(tokens[end + 1 - k : end + 1])
                    earlier = ends.get(key)
                    if earlier is not None:
                        self._before[k][key] = earlier
                    ends[key] = end + 1  # exclusive end
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

    def substituted_match(self, history: Sequence[int] | None = None) -> tuple[int, int]:
        """(length, end) of the longest key matching `history` without its last token, at its most
        recent occurrence before that token; (0, -1) when none matches. The token at `end` is the
        one the last token of `history` stands in for."""
        history = self.tokens if history is None else history
        last = len(history) - 1
        for k in self.key_lengths:
            if last < k:
                continue
            key = tuple(history[last - k : last])
            end = self._ends[k].get(key)
            if end is not None and end >= last:  # the window just before the last token itself
                end = self._before[k].get(key)
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

    def propose(self, remaining: int, min_match: int, history: Sequence[int] | None = None) -> list[int]:
        """The long match's branch: what followed the longest earlier match of `history`'s end (default:
        the indexed tokens) when it is at least `min_match` tokens long, else what followed a substituted
        match that long (the module's docstring); as many tokens as the key matched, at most
        `remaining` - 1 (the bonus token is the last). [] when neither matches."""
        history = self.tokens if history is None else history
        length, end = self.match(history)
        if length >= min_match:
            return following(history, end, min(length, remaining - 1))
        length, end = self.substituted_match(history)
        if length >= min_match:
            return substituted(history, end, min(length, remaining - 1))
        return []


def following(history: Sequence[int], end: int, depth: int) -> list[int]:
    """The `depth` tokens after an earlier occurrence ending at `end`; where it runs into the present (a
    text repeating with period p = len(history) - end), the continuation repeats that period."""
    period = len(history) - end
    return [history[end + i % period] for i in range(max(depth, 0))]


def substituted(history: Sequence[int], end: int, depth: int) -> list[int]:
    """`following` the token at `end` (an earlier stand-in for the last token of `history`), with
    that token written as the last one wherever it recurs."""
    old, new = history[end], history[-1]
    return [new if token == old else token for token in following(history, end + 1, depth)]


def match_tensors(
    history: torch.Tensor,  # [C] committed ids (the root last), then anything
    count: torch.Tensor,  # 0-d: committed ids
    remaining: torch.Tensor,  # 0-d: tokens left before the limit
    key_lengths: tuple[int, ...] = KEY_LENGTHS,
    min_match: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The long match's branch on the device with no read back: `SuffixIndex.propose` (`match` and
    `following`, else `substituted_match` and `substituted`) over the history tensor, as
    `stages.retrieve_suffix` offers it (a match of at least `min_match` tokens; as deep as it matched,
    at most `remaining` - 1). Returns tokens [MAX_DEPTH] and valid [MAX_DEPTH] (a prefix: the
    branch's depth)."""
    device = history.device
    found = torch.zeros((), dtype=torch.bool, device=device)
    end = torch.zeros((), dtype=torch.long, device=device)
    length = torch.zeros((), dtype=torch.long, device=device)
    skip = torch.zeros((), dtype=torch.long, device=device)  # 1: a substituted match
    # exact matches first, then substituted ones (the key ends one token back); longest key first
    for back in (0, 1):
        for k in sorted(set(key_lengths), reverse=True):
            if k < min_match or history.numel() < k:
                continue
            key = history[(count - back - k + torch.arange(k, device=device)).clamp(min=0)]  # [k]
            windows = history.unfold(0, k, 1)  # [C - k + 1, k]: window j covers j .. j + k - 1
            ends = torch.arange(k, history.numel() + 1, device=device)  # [C - k + 1] exclusive ends
            # windows whose next id is committed and comes before the key's end; the latest one wins
            hit = (windows == key).all(dim=1) & (ends <= count - 1 - back) & (count - back >= k)
            best = torch.where(hit, ends, -1).max()
            take = ~found & (best > 0)
            end, length = torch.where(take, best, end), torch.where(take, k, length)
            skip = torch.where(take, back, skip)
            found = found | take
    depth = torch.minimum(length, remaining - 1)
    steps = torch.arange(MAX_DEPTH, device=device)
    start = end + skip
    period = (count - start).clamp(min=1)
    last = history.numel() - 1
    tokens = history[(start + steps % period).clamp(max=last)]  # [MAX_DEPTH]
    old, new = history[end.clamp(max=last)], history[(count - 1).clamp(min=0, max=last)]
    tokens = torch.where((skip == 1) & (tokens == old), new, tokens)
    return tokens, found & (steps < depth)


# Between AR steps (`--tree auto` settled on them) the loop looks for a long match every
# `LOOKUP_EVERY` steps, after every step for `HOT_TOKENS` tokens after a branch that paid (the text is
# repeating), and verifies a branch when one is found, while that pays
LOOKUP_EVERY = 8
HOT_TOKENS = 256
BACKOFF_TOKENS = (32, 4096)  # a branch that did not pay: no lookups for this many tokens, doubling to the cap
CREDIT_STEPS = 16  # the time branches saved is banked up to this many AR steps' worth


@dataclass
class MatchGate:
    """Whether a long match's branch is verified between AR steps: measured, like the tuner's plans.
    Each branch iteration banks the time it saved against AR steps (its tokens at the last AR run's
    time per token, less its own time; up to `CREDIT_STEPS` steps' worth). Where the bank runs dry
    the gate closes for `backoff` tokens, doubling after each closing in a row; an iteration that
    pays on its own resets the backoff. A text that repeats with a change (a schedule's next hour)
    has branches that miss at its first token between branches that commit a line: the bank carries
    them, and after a branch that paid the loop looks after every AR step (`every`)."""

    ar_s_per_token: float | None = None  # the last AR run's
    closed_until: int = 0  # new-token count before which no lookup is made
    backoff: int = BACKOFF_TOKENS[0]
    credit: float = 0.0  # seconds branches saved, net, capped
    hot_until: int = 0  # new-token count before which the loop looks after every step
    wins: int = 0
    losses: int = 0

    def open(self, position: int) -> bool:
        return position >= self.closed_until

    def every(self, position: int) -> int:
        """AR steps between lookups from `position` on."""
        return 1 if position < self.hot_until else LOOKUP_EVERY

    def ar_run(self, seconds: float, steps: int) -> None:
        if steps:
            self.ar_s_per_token = seconds / steps

    def branch_run(self, position: int, seconds: float, tokens: int) -> None:
        """A branch iteration committed `tokens` from `position` on in `seconds`."""
        if self.ar_s_per_token is None:
            self.wins += 1
            return
        saved = tokens * self.ar_s_per_token - seconds
        self.credit = min(self.credit + saved, CREDIT_STEPS * self.ar_s_per_token)
        if saved >= 0:
            self.wins, self.backoff = self.wins + 1, BACKOFF_TOKENS[0]
            self.hot_until = position + tokens + HOT_TOKENS
            return
        self.losses += 1
        if self.credit < 0:
            self.credit = 0.0
            self.closed_until = position + tokens + self.backoff
            self.backoff = min(2 * self.backoff, BACKOFF_TOKENS[1])
