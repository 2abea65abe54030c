from __future__ import annotations

import random
from collections import Counter

from tokenswift_trt.decode.ngram import NgramTable


def test_counts_and_top_k_hand_computed():
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4]
    table = NgramTable(4)
    table.update(tokens, len(tokens))
    # 4-grams starting with 1: (1,2,3,4) x3, (1,2,3,5) x1
    assert table.count((1, 2, 3, 4)) == 3
    assert table.count((1, 2, 3, 5)) == 1
    assert table.top(1, 5) == [(1, 2, 3, 4), (1, 2, 3, 5)]
    assert table.top(1, 1) == [(1, 2, 3, 4)]
    # starting with 4: (4,1,2,3) x3
    assert table.top(4, 3) == [(4, 1, 2, 3)]
    # starting with 3: (3,4,1,2) x2, (3,5,1,2) x1
    assert table.top(3, 3) == [(3, 4, 1, 2), (3, 5, 1, 2)]
    assert table.top(9, 3) == []
    assert table.top(1, 0) == []


def test_ties_keep_the_gram_that_reached_the_count_first():
    table = NgramTable(2)
    for gram in [(1, 5), (1, 6), (1, 6), (1, 5)]:
        table.add(gram)
    assert table.top(1, 2) == [(1, 6), (1, 5)]


def test_window_exclusion_counts_only_grams_ending_before_the_limit():
    tokens = list(range(10))
    table = NgramTable(4)
    table.update(tokens, 6)  # grams tokens[s-4:s] for s <= 6: (0..3), (1..4), (2..5)
    assert table.count((2, 3, 4, 5)) == 1 and table.count((3, 4, 5, 6)) == 0
    table.update(tokens, 7)  # incremental: only the new gram
    assert table.count((3, 4, 5, 6)) == 1 and table.count((0, 1, 2, 3)) == 1
    table.update(tokens, 7)  # idempotent
    assert table.count((3, 4, 5, 6)) == 1


def test_top_k_matches_a_direct_count_on_random_text():
    rng = random.Random(3)
    tokens = [rng.randrange(5) for _ in range(5000)]
    table = NgramTable(4)
    for end in range(0, len(tokens) + 1, 97):  # fed in pieces, as decoding does
        table.update(tokens, end)
    table.update(tokens, len(tokens))
    counts = Counter(tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3))
    for start in range(5):
        got = table.top(start, 7)
        want = sorted((g for g in counts if g[0] == start), key=lambda g: -counts[g])[:7]
        assert [counts[g] for g in got] == [counts[g] for g in want]
        assert all(g[0] == start for g in got)
