"""The suffix index proposes what followed the longest, most recent earlier match of the text's end."""

from __future__ import annotations

import random

import pytest

from tokenswift_trt.decode.suffix import SuffixIndex


def _naive(tokens: list[int], history: list[int], keys: tuple[int, ...], depth: int) -> list[int]:
    """The same rule by brute force: longest key first, most recent earlier window with a continuation."""
    for k in sorted(keys, reverse=True):
        if len(history) < k:
            continue
        for end in range(len(tokens) - 1, k - 1, -1):  # exclusive end, a next token must exist
            if tokens[end - k : end] == history[-k:]:
                return [history[end + i % (len(history) - end)] for i in range(depth)]
    return []


def _naive_substituted(tokens: list[int], history: list[int], keys: tuple[int, ...]) -> tuple[int, int]:
    """`substituted_match` by brute force: the history without its last token, matched at the most
    recent earlier window whose next token comes before that last token."""
    last = len(history) - 1
    for k in sorted(keys, reverse=True):
        if last < k:
            continue
        for end in range(min(len(tokens) - 1, last - 1), k - 1, -1):
            if tokens[end - k : end] == history[last - k : last]:
                return k, end
    return 0, -1


def test_a_repeated_passage_proposes_its_continuation():
    passage = list(range(100, 140))
    index = SuffixIndex(key_lengths=(8, 4))
    index.extend([1, 2, 3] + passage + [7, 7] + passage[:10])
    assert index.continuation(depth=5) == passage[10:15]
    assert index.match() == (8, 3 + 10)


def test_the_longest_key_wins_over_a_more_recent_shorter_match():
    index = SuffixIndex(key_lengths=(8, 2))
    long_context = [1, 2, 3, 4, 5, 6, 7, 8]
    index.extend(long_context + [50] + [9, 7, 8, 60] + long_context)
    assert index.continuation(depth=1) == [50]  # the 8-token match, not the later "7 8 -> 60"


def test_the_most_recent_occurrence_is_used():
    index = SuffixIndex(key_lengths=(2,))
    index.extend([1, 2, 30, 1, 2, 40, 1, 2])
    assert index.continuation(depth=1) == [40]


def test_no_match_and_no_self_match():
    index = SuffixIndex(key_lengths=(3,))
    index.extend([1, 2, 3, 4])
    assert index.continuation() == []
    assert index.match() == (0, -1)


def test_an_uncommitted_root_extends_the_history():
    index = SuffixIndex(key_lengths=(2,))
    index.extend([5, 6, 7, 8, 9, 5])
    assert index.continuation(index.tokens + [6], depth=3) == [7, 8, 9]


def test_a_match_running_into_the_present_repeats_its_period():
    index = SuffixIndex(key_lengths=(4,))
    index.extend([9, 1, 2, 3, 1, 2, 3, 1, 2])  # period 3; the latest "3 1 2 ..." match ends 3 back
    assert index.continuation(depth=7) == [3, 1, 2, 3, 1, 2, 3]


@pytest.mark.parametrize("seed", range(5))
def test_incremental_extends_match_brute_force(seed):
    rng = random.Random(seed)
    keys = (6, 3, 1)
    index = SuffixIndex(key_lengths=keys)
    tokens: list[int] = []
    while len(tokens) < 400:
        chunk = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        tokens += chunk
        index.extend(chunk)
        root = rng.randrange(6)
        assert index.continuation(depth=7) == _naive(tokens, tokens, keys, 7)
        assert index.continuation(tokens + [root], depth=7) == _naive(tokens, tokens + [root], keys, 7)
        assert index.substituted_match() == _naive_substituted(tokens, tokens, keys)
        assert index.substituted_match(tokens + [root]) == _naive_substituted(tokens, tokens + [root], keys)


def test_a_substituted_match_writes_the_new_token_for_the_one_it_replaced():
    """A schedule whose hour changes on every line: after the new hour, the earlier line's
    continuation is proposed with its hour written as the new one, where no exact key matches."""
    index = SuffixIndex(key_lengths=(8,))
    tail = list(range(5, 15))  # ":30pm: 1000000\n- "-like: no hour in the last 8 before the next one
    schedule = [90, 2, 3, 90] + tail + [91, 2, 3, 91] + tail
    index.extend(schedule + [92])  # the next line's hour
    assert index.match() == (0, -1)
    length, end = index.substituted_match()
    assert length == 8 and schedule[end] == 91  # the latest earlier line stands in
    assert index.propose(remaining=9, min_match=8) == [2, 3, 92] + tail[:5]
    assert index.propose(remaining=3, min_match=8) == [2, 3]  # the bonus token is the last
    assert index.propose(remaining=9, min_match=9) == []


def test_a_substituted_match_never_points_at_the_last_token_itself():
    index = SuffixIndex(key_lengths=(3,))
    index.extend([1, 2, 3, 4, 1, 2, 3, 5])  # without its last token the text ends "1 2 3", seen at 0
    assert index.substituted_match() == (3, 3)  # the window before "4", not the one before "5"
    assert index.propose(remaining=9, min_match=3) == [1, 2, 3]  # what followed "4", as deep as the key
    index = SuffixIndex(key_lengths=(3,))
    index.extend([7, 1, 2, 3, 5])
    assert index.substituted_match() == (0, -1)


def test_key_lengths_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        SuffixIndex(key_lengths=(4, 0))


@pytest.mark.parametrize("temperature,penalty", [(0.0, 1.0), (1.0, 1.0), (1.0, 1.3)])
def test_long_matches_commit_past_the_tree_and_keep_ars_tokens(llama_engine64, temperature, penalty):
    """A repeating prompt: the long-match branch is offered deeper than the tree and the 4-grams reach
    (depth 3), and the tokens stay AR's, greedy and seeded, with a penalty too (each node's own window)."""
    from tokenswift_trt.decode.config import GenerationConfig
    from tokenswift_trt.decode.loop import generate
    from tokenswift_trt.model.sampling import SamplingConfig

    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 12
    sampling = SamplingConfig(temperature=temperature, penalty=penalty, penalty_window=16)
    settings = dict(max_new_tokens=240, sampling=sampling, ignore_eos=True, seed=7)
    swift, stats = generate(
        llama_engine64,
        prompt,
        GenerationConfig(tree="1,1,1", draft_source="verify", ngram_topk=4, **settings),
    )
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(method="ar", **settings))
    assert swift == ar
    if temperature == 0.0:  # greedy continues the prompt's period for a while
        assert len(stats.reached_by_depth) > 3  # drafts offered past depth 3: the long match's branch


def test_the_gate_closes_after_a_branch_slower_than_ar_steps_and_backs_off():
    from tokenswift_trt.decode.suffix import BACKOFF_TOKENS, MatchGate

    gate = MatchGate()
    gate.branch_run(0, 1.0, 1)  # before any AR step is timed: taken to pay
    assert gate.open(1) and gate.wins == 1
    gate.ar_run(0.8, 8)  # 0.1 s a token
    gate.branch_run(10, 0.5, 2)  # 0.25 s a token: slower
    first = BACKOFF_TOKENS[0]
    assert not gate.open(11) and not gate.open(12 + first - 1) and gate.open(12 + first)
    gate.branch_run(100, 0.5, 1)  # a second loss in a row: twice as long
    assert not gate.open(101 + 2 * first - 1) and gate.open(101 + 2 * first)
    gate.branch_run(500, 0.5, 10)  # 0.05 s a token: pays, the backoff starts over
    assert gate.backoff == first and gate.open(510)


def test_the_loop_looks_after_every_step_for_a_while_after_a_branch_that_paid():
    from tokenswift_trt.decode.suffix import HOT_TOKENS, LOOKUP_EVERY, MatchGate

    gate = MatchGate()
    gate.ar_run(1.0, 10)  # 0.1 s a token
    assert gate.every(0) == LOOKUP_EVERY > 1
    gate.branch_run(100, 0.2, 12)  # paid
    assert gate.every(112) == gate.every(112 + HOT_TOKENS - 1) == 1
    assert gate.every(112 + HOT_TOKENS) == LOOKUP_EVERY
    gate.branch_run(150, 0.3, 1)  # a miss keeps the window where it was
    assert gate.every(112 + HOT_TOKENS) == LOOKUP_EVERY


def test_the_gate_banks_what_branches_saved_and_stays_open_through_a_miss():
    from tokenswift_trt.decode.suffix import CREDIT_STEPS, MatchGate

    gate = MatchGate()
    gate.ar_run(1.0, 10)  # 0.1 s a token
    gate.branch_run(0, 0.2, 12)  # saved 1.0 s
    assert gate.credit == pytest.approx(1.0)
    gate.branch_run(12, 0.12, 1)  # a miss at the first token: 0.02 s lost, carried by the bank
    assert gate.open(13) and gate.losses == 1 and gate.credit == pytest.approx(0.98)
    gate.branch_run(13, 0.1, 100)  # the bank is capped
    assert gate.credit == pytest.approx(CREDIT_STEPS * 0.1)
    for position in range(200, 200 + 2 * CREDIT_STEPS):  # misses until the bank runs dry
        gate.branch_run(position, 0.25, 1)
        if not gate.open(position + 1):
            break
    assert not gate.open(position + 1) and gate.credit == 0.0
    assert position == 200 + int(CREDIT_STEPS * 0.1 / 0.15)  # 0.15 s lost each: the 11th closes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_tuners_ar_steps_verify_long_matches_and_keep_ars_tokens(
    llama_engine64, monkeypatch, temperature
):
    """`--tree auto` settled on AR steps (no budget to explore): where the text repeats, the loop
    verifies the long match's branch alone between AR steps, and the tokens stay AR's."""
    from tokenswift_trt.decode import autotune
    from tokenswift_trt.decode.config import GenerationConfig
    from tokenswift_trt.decode.loop import generate
    from tokenswift_trt.model.sampling import SamplingConfig

    monkeypatch.setattr(autotune, "EXPLORATION_BUDGET", 0.0)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 12
    settings = dict(
        max_new_tokens=200, sampling=SamplingConfig(temperature=temperature), ignore_eos=True, seed=3
    )
    swift, stats = generate(llama_engine64, prompt, GenerationConfig(tree="auto", **settings))
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(method="ar", **settings))
    assert swift == ar
    assert all(plan.tree is None for plan in stats.plans[1:])  # AR steps after the probe
    if temperature == 0.0:  # greedy continues the prompt's period: branches commit several tokens
        assert stats.branch_iterations > 0 and stats.iterations < len(swift)


@pytest.mark.parametrize("seed", range(6))
def test_the_device_form_offers_the_host_forms_branch(seed):
    """`match_tensors` over a history tensor (committed ids, then stale ones) gives the branch
    `retrieve_suffix` gives from the index: the same tokens, as deep, for any remaining budget,
    from exact and from substituted matches."""
    import torch

    from tokenswift_trt.decode.stages import SUFFIX_MIN_MATCH
    from tokenswift_trt.decode.suffix import MAX_DEPTH, match_tensors

    generator = torch.Generator().manual_seed(seed)
    vocab = [2, 3, 50][seed % 3]  # small vocabularies repeat by chance too
    offered_substituted = 0
    for _ in range(20):
        count = int(torch.randint(1, 90, (1,), generator=generator))
        tokens = torch.randint(0, vocab, (count,), generator=generator).tolist()
        start = int(torch.randint(0, count, (1,), generator=generator))
        stretch = tokens[start : start + 40]
        if seed % 2:  # a repeated stretch, then a few tokens of it again
            tokens += stretch + stretch[:9]
        elif len(stretch) > 9:  # the same, then a token standing in for the stretch's tenth
            tokens += stretch + stretch[:9] + [stretch[9] + 1]
        count = len(tokens)
        remaining = int(torch.randint(1, 40, (1,), generator=generator))
        index = SuffixIndex()
        index.extend(tokens)
        expected = index.propose(remaining, SUFFIX_MIN_MATCH)
        substituted_only = not index.match()[0] >= SUFFIX_MIN_MATCH and expected
        offered_substituted += bool(substituted_only)
        history = torch.cat((torch.tensor(tokens), torch.randint(0, vocab, (64,), generator=generator)))
        ids, valid = match_tensors(history, torch.tensor(count), torch.tensor(remaining))
        assert ids.shape == valid.shape == (MAX_DEPTH,)
        depth = int(valid.sum())
        assert valid[:depth].all() and ids[:depth].tolist() == expected
    assert offered_substituted > 0 or seed % 2  # even seeds build substituted matches
