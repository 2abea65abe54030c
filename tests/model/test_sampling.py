"""Each logits processor against its written formula; position-keyed Gumbel noise; Gumbel-max
sampling; draft ranking with the target's noise."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from tokenswift_trt.model import sampling
from tokenswift_trt.model.sampling import (
    PositionKeyedRandom,
    SamplingConfig,
    apply_penalty,
    choose_token,
    draft_ranking,
    eta_filter,
    gumbel_max_sample,
    keyed_uniforms,
    min_p_filter,
    position_gumbel,
    process_logits,
    top_k_filter,
    top_p_filter,
)

NEG = float("-inf")


def _kept(scores: torch.Tensor) -> set[int]:
    return set(torch.nonzero(scores > NEG).flatten().tolist())


def _random_logits(seed: int, size: int = 50) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def test_penalty_divides_positive_and_multiplies_negative_once_per_token():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    out = apply_penalty(logits, torch.tensor([0, 1, 1, 1]), 2.0)  # repeats penalise once
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]
    assert apply_penalty(logits, torch.tensor([0]), 1.0) is logits


@pytest.mark.parametrize("seed", range(5))
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(seed):
    scores = _random_logits(seed)
    probs = scores.softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    for top_p in (0.1, 0.5, 0.9):
        want, mass = set(), 0.0
        for index in order:  # formula: add most probable tokens until the mass reaches top_p
            want.add(index)
            mass += probs[index]
            if mass >= top_p:
                break
        assert _kept(top_p_filter(scores, top_p)) == want


@pytest.mark.parametrize("seed", range(5))
def test_min_p_keeps_tokens_above_fraction_of_max_and_at_least_20(seed):
    scores = _random_logits(seed, size=60)
    probs = scores.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    for min_p in (0.05, 0.3, 0.9):
        above = {i for i in range(60) if probs[i] >= min_p * probs.max()}
        want = above | set(order[:20])
        assert _kept(min_p_filter(scores, min_p)) == want
    small = _random_logits(seed, size=8)  # fewer than 20 tokens: all kept
    assert _kept(min_p_filter(small, 0.9)) == set(range(8))


@pytest.mark.parametrize("seed", range(5))
def test_eta_threshold_is_min_of_eta_and_sqrt_eta_times_exp_minus_entropy(seed):
    scores = _random_logits(seed) * 2
    probs = scores.softmax(-1).tolist()
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    for eta in (0.0009, 0.02, 0.3):
        threshold = min(eta, math.sqrt(eta) * math.exp(-entropy))
        want = {i for i, p in enumerate(probs) if p >= threshold} | {
            max(range(len(probs)), key=probs.__getitem__)
        }
        assert _kept(eta_filter(scores, eta)) == want


def test_top_k_keeps_k_largest():
    scores = torch.tensor([0.1, 5.0, -2.0, 3.0, 4.0])
    assert _kept(top_k_filter(scores, 2)) == {1, 4}
    assert _kept(top_k_filter(scores, 0)) == set(range(5))


def test_process_logits_order_penalty_then_temperature_then_truncation():
    logits = torch.tensor([4.0, 3.9, 1.0, 0.0])
    config = SamplingConfig(temperature=0.5, top_k=2, penalty=2.0, penalty_window=4)
    out = process_logits(logits, torch.tensor([0]), config)
    # token 0 penalised to 2.0 first, so top-2 after temperature are tokens 1 and 0
    assert out[1] == pytest.approx(3.9 / 0.5) and out[0] == pytest.approx(2.0 / 0.5)
    assert out[2] == NEG and out[3] == NEG
    greedy = process_logits(logits, torch.tensor([0]), SamplingConfig(temperature=0, penalty=2.0))
    assert choose_token(greedy, SamplingConfig(temperature=0), PositionKeyedRandom(0), 5) == 1


def _splitmix64(value: int) -> int:  # the hash written out on Python ints, as a reference
    mask = (1 << 64) - 1
    value = (value + 0x9E3779B97F4A7C15) & mask
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
    return value ^ (value >> 31)


def test_keyed_uniforms_equal_the_hash_on_integers():
    key = 0xDEADBEEFCAFEF00D
    expected = [((_splitmix64(i ^ key) >> 11) + 0.5) * 2.0**-53 for i in range(300)]
    assert keyed_uniforms(key, 300).tolist() == expected
    values = keyed_uniforms(key, 100_000)
    assert 0 < float(values.min()) and float(values.max()) < 1


def test_position_gumbel_is_a_pure_function_of_seed_and_position():
    noise = position_gumbel(7, 12, 50_000)
    assert torch.equal(noise, position_gumbel(7, 12, 50_000))
    assert not torch.equal(noise, position_gumbel(8, 12, 50_000))
    assert not torch.equal(noise, position_gumbel(7, 13, 50_000))
    assert float(noise.mean()) == pytest.approx(0.5772, abs=0.02)  # Euler's constant
    assert float(noise.std()) == pytest.approx(math.pi / math.sqrt(6), abs=0.02)
    memo = PositionKeyedRandom(7)
    assert torch.equal(memo.gumbel(12, 50_000, torch.device("cpu")), noise)


def test_noise_rows_equal_each_positions_noise_across_memo_refills():
    source, cpu = PositionKeyedRandom(9), torch.device("cpu")
    for start in range(0, 3 * PositionKeyedRandom.MEMO, 7):  # batches overlap the memo and overflow it
        positions = [start, start + 3, start, start + 1] + list(range(start + 2, start + 12))
        rows = source.gumbel_rows(positions, 300, cpu)
        assert rows.shape == (len(positions), 300)
        for row, position in zip(rows, positions):
            assert torch.equal(row, position_gumbel(9, position, 300))
    assert torch.equal(source.gumbel(5, 300, cpu), position_gumbel(9, 5, 300))
    many = list(range(500, 500 + PositionKeyedRandom.MEMO + 6))  # more rows than the memo keeps
    rows = source.gumbel_rows(many, 300, cpu)
    assert all(torch.equal(row, position_gumbel(9, p, 300)) for row, p in zip(rows, many))


def test_noise_is_hashed_ahead_so_decoding_rarely_computes_it(monkeypatch):
    """Decoding asks for the next few positions every iteration; the hash runs once per LOOKAHEAD / 2."""
    calls = []
    original = sampling.position_gumbel_rows

    def counted(seed, positions, index):
        calls.append(list(positions))
        return original(seed, positions, index)

    monkeypatch.setattr(sampling, "position_gumbel_rows", counted)
    source, cpu = PositionKeyedRandom(4), torch.device("cpu")
    asked = {
        root: source.gumbel_rows([root + 1, root + 2, root + 3, root + 4], 64, cpu)
        for root in range(0, 40, 2)
    }  # 20 iterations committing 2 tokens each, 4 positions asked for
    assert len(calls) == 3  # roots 0, 16 and 32
    monkeypatch.undo()
    for root, rows in asked.items():
        assert all(torch.equal(rows[d], position_gumbel(4, root + 1 + d, 64)) for d in range(4))


def test_gumbel_max_with_position_noise_samples_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05], dtype=torch.float64)
    scores = probs.log()
    counts = torch.zeros(5)
    for position in range(4000):
        counts[gumbel_max_sample(scores, position_gumbel(3, position, 5))] += 1
    assert counts[1] == 0  # excluded tokens are never drawn
    kept = probs > 0
    assert chisquare(counts[kept].tolist(), (probs[kept] * 4000).tolist()).pvalue > 1e-3


def test_draft_ranking_puts_the_targets_draw_first_when_the_draft_is_exact():
    target = _random_logits(1, 200)[None].repeat(6, 1)  # [6, V]
    noises = torch.stack([position_gumbel(5, p, 200) for p in range(6)])
    ranked = draft_ranking(target, noises, 3)
    assert ranked.shape == (6, 3)
    for row in range(6):
        assert int(ranked[row, 0]) == gumbel_max_sample(target[row], noises[row])
        assert len(set(ranked[row].tolist())) == 3
    # greedy: plain top-k of the draft's scores
    assert draft_ranking(target, None, 3)[0].tolist() == target[0].topk(3).indices.tolist()


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top-p"),
        ("top_p", 1.5, "top-p"),
        ("min_p", 1.0, "min-p"),
        ("min_p", -0.1, "min-p"),
        ("penalty", 0.9, "penalty"),
        ("top_k", -1, "top-k"),
        ("eta", 1.0, "eta"),
    ],
)
def test_out_of_range_values_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**{field: value}).validate()


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(penalty=1.3, penalty_window=8, top_k=7),
        SamplingConfig(top_p=0.8, temperature=0.7),
        SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=8),
        SamplingConfig(eta=0.02),
        SamplingConfig(temperature=0),
    ],
)
def test_rows_processed_as_a_batch_equal_rows_processed_alone(config):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 3
    window = torch.tensor([3, 7, 7, 12, 40, 2])
    batched = process_logits(logits, window, config)
    for row in range(4):
        assert torch.equal(batched[row], process_logits(logits[row], window, config))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")
def test_position_gumbel_is_the_same_on_the_gpu():
    cpu = position_gumbel(11, 123_456, 128_256)
    gpu = position_gumbel(11, 123_456, 128_256, "cuda").cpu()
    assert torch.equal(keyed_uniforms(99, 4096), keyed_uniforms(99, 4096, "cuda").cpu())
    assert torch.allclose(cpu, gpu, rtol=0, atol=1e-12)
