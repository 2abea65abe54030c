"""Token reutilisation: counts of committed 4-grams and their top-k per start token.

Insert is O(1): per start token, grams sit in buckets by count (dicts used as ordered sets), and the
non-empty counts form a doubly linked list, so a count moving up by one touches a constant number
of entries and top-k walks from the highest bucket down without sorting. Ties keep the gram that
reached the count first.
"""

from __future__ import annotations

from collections.abc import Sequence

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

    def __init__(self, n: int = 4) -> None:
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
