"""Metrics as the paper reports them.

- acceptance rate α = accepted draft tokens / drafted tokens (drafted = tree depth per iteration),
- n-gram acceptance β = draft tokens accepted along an n-gram branch / drafted tokens,
- Distinct-n = unique n-grams / total n-grams of the generated tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

PAPER_ACCEPT_LENGTH = 4.36  # 4α + 1 with the paper's α = 0.84 (LLaMA3.1-8B, 100K tokens)


def distinct_n(tokens: Sequence[int], n: int) -> float:
    """Unique n-grams / total n-grams (0 when the sequence is shorter than n)."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    return len({tuple(tokens[i : i + n]) for i in range(total)}) / total


def acceptance_rate(accepted: int, drafted: int) -> float:
    return accepted / drafted if drafted else 0.0


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)
