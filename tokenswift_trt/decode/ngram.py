"""Token reutilisation: counts of committed 4-grams and their top-k per start token.

One table, two forms with the same semantics: `NgramTable` on the host (the host loop) and
`NgramTensors` on the device (the device loop; every update a fixed sequence of tensor operations,
nothing read back). Both count every gram exactly and rank a start token's grams by count, ties to the
gram that reached its count first; tests/decode/test_ngram.py compares them on random text.

Host form: insert is O(1): per start token, grams sit in buckets by count (dicts used as ordered
sets), and the non-empty counts form a doubly linked list, so a count moving up by one touches a
constant number of entries and top-k walks from the highest bucket down without sorting. Ties keep
the gram that reached the count first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NGRAM_LENGTH = 4  # a start token and 3 continuation tokens
Gram = tuple[int, ...]


class _StartEntry:
    """Grams sharing one start token, bucketed by count."""

    __slots__ = ("counts", "buckets", "lower", "higher", "highest", "lowest")

    def __init__(self) -> None:
        self.counts: dict[Gram, int] = {}
        self.buckets: dict[int, dict[Gram, None]] = {}
        self.lower: dict[int, int] = {}  # count -> next smaller non-empty count (0 = none)
        self.higher: dict[int, int] = {}  # count -> next larger non-empty count (0 = none)
        self.highest = 0
        self.lowest = 0

    def _link_after(self, count: int, new: int) -> None:
        """Insert bucket `new` just above `count` (0 = at the bottom)."""
        above = self.higher[count] if count else self.lowest
        self.buckets[new] = {}
        self.lower[new], self.higher[new] = count, above
        if count:
            self.higher[count] = new
        else:
            self.lowest = new
        if above:
            self.lower[above] = new
        else:
            self.highest = new

    def _unlink(self, count: int) -> None:
        below, above = self.lower.pop(count), self.higher.pop(count)
        del self.buckets[count]
        if below:
            self.higher[below] = above
        else:
            self.lowest = above
        if above:
            self.lower[above] = below
        else:
            self.highest = below

    def add(self, gram: Gram) -> None:
        old = self.counts.get(gram, 0)
        new = old + 1
        self.counts[gram] = new
        if new not in self.buckets:
            self._link_after(old, new)
        self.buckets[new][gram] = None
        if old:
            bucket = self.buckets[old]
            del bucket[gram]
            if not bucket:
                self._unlink(old)

    def top(self, k: int) -> list[Gram]:
        found: list[Gram] = []
        count = self.highest
        while count and len(found) < k:
            for gram in self.buckets[count]:
                found.append(gram)
                if len(found) == k:
                    break
            count = self.lower[count]
        return found


class NgramTable:
    """Counts of n-grams (default 4) of a token sequence, fed incrementally."""

    def __init__(self, n: int = NGRAM_LENGTH) -> None:
        self.n = n
        self._starts: dict[int, _StartEntry] = {}
        self.inserted_until = 0  # grams ending before this index of the sequence are counted

    def add(self, gram: Sequence[int]) -> None:
        key = tuple(gram)
        entry = self._starts.get(key[0])
        if entry is None:
            entry = self._starts[key[0]] = _StartEntry()
        entry.add(key)

    def count(self, gram: Sequence[int]) -> int:
        entry = self._starts.get(gram[0])
        return entry.counts.get(tuple(gram), 0) if entry else 0

    def top(self, start: int, k: int) -> list[Gram]:
        """The k most frequent grams beginning with `start`, most frequent first."""
        entry = self._starts.get(start)
        return entry.top(k) if entry and k > 0 else []

    def update(self, tokens: Sequence[int], end: int) -> None:
        """Count every gram of `tokens` that ends before index `end` and was not counted yet."""
        first_end = max(self.inserted_until, self.n)
        for stop in range(first_end, end + 1):
            self.add(tokens[stop - self.n : stop])
        self.inserted_until = max(self.inserted_until, end + 1)


class NgramTensors:
    """`NgramTable` on the device, for one sequence's `history` [capacity] of token ids.

    A gram is known by the index of its first occurrence in the history, `counts` [capacity] holds its
    count there; per start token the k best grams are kept (`first` [V, k], -1 empty) with the end index
    at which each reached its count (`stamps` [V, k]). Counts only grow by one, so a gram outside a
    start's k best enters exactly when its count passes the worst kept one's (least counted, of those
    the one that reached its count last), which it then replaces: the kept grams are always the exact
    top k of `NgramTable.top`, in its order. `add` finds a gram's first occurrence by comparing it with
    every window of the history (one fixed-shape comparison, cheap on a GPU).
    """

    def __init__(self, vocab: int, k: int, history: torch.Tensor) -> None:
        device, capacity = history.device, history.numel()
        self.k, self.history = k, history
        self.first = torch.full((vocab, k), -1, dtype=torch.long, device=device)
        self.stamps = torch.zeros(vocab, k, dtype=torch.long, device=device)
        self.counts = torch.zeros(capacity, dtype=torch.long, device=device)
        self.starts = torch.arange(capacity - NGRAM_LENGTH + 1, device=device)  # each window's start index
        self.offsets = torch.arange(NGRAM_LENGTH, device=device)
        self.scale = capacity + 1  # above any stamp: count * scale - stamp orders by count, then stamp
        self.counted_until = 0  # as NgramTable.inserted_until: grams ending before this index are counted

    def tensors(self) -> list[torch.Tensor]:
        """The table's state (what a graph capture's warm-up must put back)."""
        return [self.first, self.stamps, self.counts]

    def _scores(self, first: torch.Tensor, stamps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """first, stamps [..., k] -> (counts, rank scores) [..., k]: higher ranks first, empty slots -1."""
        counts = torch.where(first >= 0, self.counts[first.clamp(min=0)], 0)
        return counts, torch.where(first >= 0, counts * self.scale - stamps, -1)

    def add(self, stop: torch.Tensor, valid: torch.Tensor) -> None:
        """Count the gram history[stop - 4 : stop] where `valid` (0-d bool; stop 0-d, >= 4 where valid)."""
        start = (stop - NGRAM_LENGTH).clamp(min=0)
        gram = self.history[start + self.offsets]  # [4]
        windows = self.history.unfold(0, NGRAM_LENGTH, 1)  # [capacity - 3, 4]
        match = (windows == gram).all(-1) & (self.starts <= start)  # the gram itself matches at `start`
        first = match.long().argmax().reshape(1)  # [1] its first occurrence
        self.counts.index_add_(0, first, valid.long().reshape(1))
        head = gram[:1]  # [1] the start token
        row_first, row_stamps = self.first.index_select(0, head)[0], self.stamps.index_select(0, head)[0]
        row_counts, scores = self._scores(row_first, row_stamps)  # [k]
        present = row_first == first  # [k]
        worst = scores.argmin()  # the first empty slot, else the worst kept gram
        enters = present.any() | (self.counts[first][0] > row_counts[worst])
        slot = torch.where(present.any(), present.long().argmax(), worst).reshape(1)
        write = valid & enters
        self.first.index_put_((head, slot), torch.where(write, first, row_first[slot]))
        self.stamps.index_put_((head, slot), torch.where(write, stop.reshape(1), row_stamps[slot]))

    def add_committed(self, count: torch.Tensor, committed: torch.Tensor, exclusion: int, most: int) -> None:
        """The grams an iteration's commit completes: `committed` (0-d, at most `most`) tokens after the
        first `count` (0-d), grams ending before the last `exclusion` tokens (no value read back)."""
        for offset in range(most):
            stop = count - exclusion + 1 + offset  # exclusive end of the gram
            self.add(stop, (offset < committed) & (stop >= NGRAM_LENGTH))

    def update(self, end: int) -> None:
        """As `NgramTable.update`: count every gram of the history ending before index `end` not
        counted yet (host-driven, between device iterations: the prompt's, or after AR steps). An
        empty table, or many new grams, is rebuilt from the whole history in a few vectorised ops."""
        first_end = max(self.counted_until, NGRAM_LENGTH)
        if end < first_end:
            return
        if self.counted_until == 0 or end - first_end > 16:
            self._rebuild(end)
        else:
            on = torch.ones((), dtype=torch.bool, device=self.history.device)
            for stop in range(first_end, end + 1):
                self.add(torch.tensor(stop, device=self.history.device), on)
        self.counted_until = end + 1

    def _rebuild(self, end: int) -> None:
        """The table of history[:end]: exact counts, per start token the k best by count, ties to the
        earlier last occurrence (where each gram reached its count)."""
        self.first.fill_(-1)
        self.stamps.zero_()
        self.counts.zero_()
        grams = self.history[:end].unfold(0, NGRAM_LENGTH, 1)  # [n, 4]
        number, device = grams.shape[0], grams.device
        unique, inverse, counts = torch.unique(grams, dim=0, return_inverse=True, return_counts=True)
        order = torch.arange(number, device=device)
        first = torch.full((unique.shape[0],), number, dtype=torch.long, device=device)
        first.scatter_reduce_(0, inverse, order, reduce="amin")  # [u] first occurrence
        last = torch.full((unique.shape[0],), -1, dtype=torch.long, device=device)
        last.scatter_reduce_(0, inverse, order, reduce="amax")  # [u] last occurrence
        stamps = last + NGRAM_LENGTH  # the end index at which each gram reached its count
        self.counts[first] = counts
        # rank by (start, count descending, stamp): stable sorts, least significant key first
        rank = stamps.argsort(stable=True)
        rank = rank[(-counts[rank]).argsort(stable=True)]
        rank = rank[unique[rank, 0].argsort(stable=True)]
        starts = unique[rank, 0]  # [u] sorted
        place = torch.arange(starts.numel(), device=device) - torch.searchsorted(starts, starts)
        kept = place < self.k  # the k best of each start token
        self.first[starts[kept], place[kept]] = first[rank[kept]]
        self.stamps[starts[kept], place[kept]] = stamps[rank[kept]]

    def top(self, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """start 0-d -> (continuations [k, 3] best first, valid [k] bool): `NgramTable.top(start, k)`."""
        row = start.reshape(1)
        row_first, row_stamps = self.first.index_select(0, row)[0], self.stamps.index_select(0, row)[0]
        _, scores = self._scores(row_first, row_stamps)
        order = scores.argsort(descending=True, stable=True)
        kept = row_first[order]  # [k]
        ids = self.history[(kept.clamp(min=0) + 1)[:, None] + self.offsets[None, : NGRAM_LENGTH - 1]]
        return ids, kept >= 0
