from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tokenswift_trt.decode.ngram import NGRAM_LENGTH, NgramTable, NgramTensors


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


def _device_top(table: NgramTensors, start: int) -> list[tuple[int, ...]]:
    ids, valid = table.top(torch.tensor(start))
    return [(start, *row) for row, kept in zip(ids.tolist(), valid.tolist()) if kept]


@pytest.mark.parametrize("vocab,k", [(4, 3), (9, 5), (30, 20)])
def test_the_device_form_keeps_the_host_tables_top_k_in_its_order(vocab, k):
    """`NgramTensors` (a prompt's table rebuilt in one go, then grams added one at a time as the device
    loop's commits add them, and caught up after a gap) ranks every start token's grams as
    `NgramTable.top` does: the same grams, counts, and ties to the gram that reached its count first."""
    rng = random.Random(vocab)
    tokens = [rng.randrange(vocab) for _ in range(700)]
    history = torch.tensor(tokens + [0] * 8)
    host, device = NgramTable(NGRAM_LENGTH), NgramTensors(vocab, k, history)
    on = torch.ones((), dtype=torch.bool)
    end = 150
    host.update(tokens, end)
    device.update(end)  # the prompt: rebuilt from the whole history
    for step in range(300):
        if step == 200:  # a gap (AR steps): caught up by one update
            end += 40
            host.update(tokens, end)
            device.update(end)
        end += 1
        host.update(tokens, end)
        device.add(torch.tensor(end), on)  # as `add_committed` does in an iteration
        device.add(torch.tensor(end + 1), torch.zeros((), dtype=torch.bool))  # not valid: no change
        if step % 37 == 0 or step == 299:
            for start in range(vocab):
                assert _device_top(device, start) == host.top(start, k)
    for start in range(vocab):
        for gram in _device_top(device, start):
            first = next(i for i in range(len(tokens)) if tuple(tokens[i : i + 4]) == gram)
            assert device.counts[first] == host.count(gram)


def test_device_form_counts_a_whole_iterations_grams_with_the_window_exclusion():
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 5]
    history = torch.tensor(tokens + [0] * 8)
    host, device = NgramTable(NGRAM_LENGTH), NgramTensors(6, 2, history)
    host.update(tokens, 10)
    device.update(10)
    # an iteration that committed 5 tokens after 12, grams ending before the last 2 (a penalty window)
    device.add_committed(torch.tensor(12), torch.tensor(5), exclusion=2, most=6)
    host.update(tokens, 12 + 5 - 2)
    for start in range(6):
        assert _device_top(device, start) == host.top(start, 2)
    assert host.top(1, 2) == [(1, 2, 3, 4), (1, 2, 3, 5)]
