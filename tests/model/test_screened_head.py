"""The float16-screened LM head (model/screened_head.py) gives sampling exactly what the full head does."""

from __future__ import annotations

import math

import pytest
import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.linear import TILED_MAX_ROWS, Linear, tiled_kernels
from tokenswift_trt.model.sampling import (
    MIN_P_KEEP,
    SamplingConfig,
    TorchSampler,
    fused_sampler,
    process_logits,
)
from tokenswift_trt.model.screened_head import SCREENED_SCORE, ScreenedHead, screenable

from conftest import quiet_load

pytestmark = pytest.mark.skipif(
    tiled_kernels() is None, reason="the screened head needs the tiled kernel (x86 AVX2 CPU, C++ compiler)"
)

SETTINGS = [
    SamplingConfig(temperature=0),
    SamplingConfig(temperature=0, penalty=1.3, penalty_window=16),
    SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=32),  # the paper's
    SamplingConfig(min_p=0.05, temperature=0.7, penalty=1.5, penalty_window=8),
    SamplingConfig(min_p=0.3, temperature=1.3),
]


LEAD = 400.0  # |x| along the lead direction: float16's error on a logit is then ~0.1, far above the margins


def _head(vocab: int, depth: int, seed: int) -> Linear:
    """Random rows, and ladders of rows along row 0's direction u whose logits for x = LEAD u sit
    0.01 apart across every cut the settings make (max - 3.3 .. max - 1.3) and around the maximum
    itself (max -0.1 .. +0.1): near-ties that float16 reorders."""
    generator = torch.Generator().manual_seed(seed)
    head = Linear(depth, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, depth, generator=generator) * 0.1)
        lead = head.weight[0].norm()
        u = head.weight[0] / lead
        offsets = torch.cat((torch.linspace(3.3, 1.3, 200), torch.linspace(0.1, -0.1, 20)))  # below max
        noise = 1e-5 * torch.randn(offsets.numel(), depth, generator=generator)
        head.weight[1 : 1 + offsets.numel()] = (lead - offsets / LEAD)[:, None] * u + noise
    assert head.pack()
    return head


def _rows(head: Linear, count: int, seed: int) -> torch.Tensor:
    """x [count, K]: half the rows LEAD along row 0 (a few tokens far ahead, near-ties at the cut),
    the others random (logits spread like a language model's over many tokens)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, head.in_features, generator=generator) * 3
    u = head.weight[0].detach() / head.weight[0].detach().norm()
    x[: max(1, count // 2)] = LEAD * u + 0.01 * x[: max(1, count // 2)]
    return x


def _samples(
    config: SamplingConfig, logits: torch.Tensor, windows: torch.Tensor, seed: int
) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    noise = None
    if not config.greedy:
        uniform = torch.rand(logits.shape, generator=generator, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        noise = -torch.log(-torch.log(uniform))
    fused = fused_sampler(config, torch.device("cpu"), torch.float32)
    assert fused is not None
    return [fused.samples(logits, windows, noise), TorchSampler(config).samples(logits, windows, noise)]


@pytest.mark.parametrize("config", SETTINGS, ids=str)
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_screened_logits_are_the_full_heads_bits_wherever_sampling_can_draw(config, rows):
    head = _head(vocab=3000, depth=64, seed=rows)
    screened = ScreenedHead.of(head)
    assert screened is not None and screened.applies(rows, config) is False  # outside inference mode
    x = _rows(head, rows, seed=rows + 1)
    windows = torch.randint(0, 300, (rows, 24), generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        assert screened.applies(rows, config)
        full = head(x)
        logits = screened.logits(x, config, windows)
    kept = logits > SCREENED_SCORE / 2
    assert torch.equal(logits[kept], full[kept])  # the same bits, not just close
    # every token sampling keeps from the full head (the argmax, greedy) was computed
    processed = process_logits(full, windows, config)
    drawable = processed == processed.max(-1, keepdim=True).values if config.greedy else processed > -math.inf
    assert torch.all(kept[drawable])
    assert (full - screened.kernels.linear(x, screened.half, x.new_empty(0), 3000)).abs().max() > 0.01
    assert torch.all(logits[~kept] == SCREENED_SCORE)
    assert kept.sum(1).max() < 3000 // 4  # it screens: most tokens are never computed in float32
    assert kept.sum(1).min() >= (1 if config.greedy else MIN_P_KEEP)
    for seed in range(25):
        assert _samples(config, logits, windows, seed) == _samples(config, full, windows, seed)


def test_the_float16_bound_holds_for_every_token():
    head = _head(vocab=3000, depth=64, seed=5)
    screened = ScreenedHead.of(head)
    x = _rows(head, 8, seed=6)
    with torch.inference_mode():
        full = head(x).double()
        approx = screened.kernels.linear(x, screened.half, x.new_empty(0), 3000).double()
    bound = x.double().norm(dim=1, keepdim=True) * screened.bounds.double()[None]
    assert torch.all((full - approx).abs() <= bound)
    assert (full - approx).abs().max() > 0  # float16 does change the products


def test_the_full_head_runs_where_screening_does_not_apply(monkeypatch):
    head = _head(vocab=3000, depth=64, seed=7)
    screened = ScreenedHead.of(head)
    paper = SamplingConfig(min_p=0.1, penalty=1.2)
    for config in (
        SamplingConfig(top_p=0.9, min_p=0.1),
        SamplingConfig(top_k=40),
        SamplingConfig(eta=0.01),
        SamplingConfig(),  # temperature sampling without min-p draws from every token
        SamplingConfig(min_p=0.1, temperature=1e-7),  # the screened score would overflow
    ):
        assert not screenable(config)
    assert screenable(paper)
    with torch.inference_mode():
        assert screened.applies(4, paper) and not screened.applies(TILED_MAX_ROWS + 1, paper)
    with torch.no_grad():
        head.weight.mul_(1.01)  # a changed weight: the float16 copy is stale
    with torch.inference_mode():
        assert not screened.applies(4, paper)
    biased = Linear(8, 40, bias=True)
    biased.pack()
    assert ScreenedHead.of(biased) is None


def test_generation_is_unchanged_and_ar_still_equals_tokenswift(llama_dir, monkeypatch):
    engine = quiet_load(llama_dir[0])
    model = engine.model
    assert model.screened_head is not None
    unscreened = quiet_load(llama_dir[0], kernels=KernelConfig(screened_head=False))
    assert unscreened.model.screened_head is None
    calls = []
    original = model.screened_head.logits
    monkeypatch.setattr(model.screened_head, "logits", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    prompt = list(range(5, 25))
    for sampling in (
        SamplingConfig(temperature=0),
        SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16),
    ):
        settings = dict(max_new_tokens=40, sampling=sampling, seed=3, ignore_eos=True)
        methods = [
            GenerationConfig(**settings, method="ar"),
            # verifying a trie drafted on the partial cache samples its nodes through the screened head
            # (drafting from the verify pass with layers that read no root takes the base and draft
            # rows from one full-head pass instead)
            GenerationConfig(**settings, tree="3,1", draft_source="partial"),
            GenerationConfig(**settings, tree="3,1", draft_source="verify"),
        ]
        screened = [generate(engine, prompt, config)[0] for config in methods]
        before = len(calls)
        full = [generate(unscreened, prompt, config)[0] for config in methods]
        assert len(calls) == before  # switched off: the full head ran
        assert screened == full and all(tokens == full[0] for tokens in screened)
    assert 1 in calls and max(calls) > 1  # AR steps and verifications both went through it
