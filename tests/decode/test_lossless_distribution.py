"""Sampling is lossless in distribution, and the test has the power to reject a biased rule.

With independent random numbers (not position-keyed) TokenSwift's output tokens 2 and 3 are
compared with their exact AR distribution, enumerated on a model with an 8-token vocabulary.
The research code's rule (one target sample per candidate row, keep the longest match) must fail
the same test.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.stages import Acceptance, NodeTargets, accept_trie
from tokenswift_trt.decode.tree import Trie
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import IndependentRandom, SamplingConfig, process_logits

from helpers import llama_config, save_hf_model

VOCAB = 8
SAMPLES = 1200  # the biased rule: p ~ 1e-116 at 2,500 samples, 4e-52 at 1,200 (the bar is 1e-6)
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95, penalty=1.5, penalty_window=3)
PROMPT = [1, 2, 3, 1, 2, 3, 4, 5]


def accept_rows(trie: Trie, targets: NodeTargets, remaining: int, stop_tokens: frozenset) -> Acceptance:
    """The biased rule: an independent target sample per candidate row; the longest match wins."""
    best: Acceptance | None = None
    for leaf in (i for i in range(len(trie)) if not trie.children[i]):
        path = []
        node = leaf
        while node > 0:
            path.append(node)
            node = trie.parents[node]
        nodes, tokens, node = [], [], 0
        for child in reversed(path):
            token = targets.sample(node)  # a fresh number for this row
            tokens.append(token)
            if token != trie.tokens[child] or len(tokens) >= remaining:
                break
            nodes.append(child)
            node = child
        else:
            tokens.append(targets.sample(node))
        if best is None or len(nodes) > len(best.nodes):
            best = Acceptance(nodes, tokens)
    assert best is not None
    return best


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vocab8")
    save_hf_model(llama_config(vocab_size=VOCAB, initializer_range=0.5), directory, seed=4)
    tensors = load_file(str(directory / "model.safetensors"))
    generator = torch.Generator().manual_seed(9)
    for i in range(3):  # random draft layers, so drafts vary by depth
        tensors[f"model.medusa_layers.{i}.linear.weight"] = torch.randn(64, 64, generator=generator)
        tensors[f"model.medusa_layers.{i}.input_layernorm.weight"] = torch.ones(64)
        tensors[f"model.medusa_layers.{i}.post_layernorm.weight"] = torch.ones(64)
    save_file(tensors, str(directory / "model.safetensors"))
    return load_engine(directory, dtype=torch.float64)


def _ar_probs(engine, tokens: list[int]) -> torch.Tensor:
    """Exact AR distribution of the token after `tokens` [V]."""
    c = engine.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(tokens), dtype=torch.float64)
    hidden = engine.model(torch.tensor(tokens), torch.arange(len(tokens)), cache).hidden[-1]
    window = torch.tensor(tokens[-SAMPLING.penalty_window :])
    return process_logits(engine.model.logits(hidden), window, SAMPLING).to(torch.float64).softmax(-1)


def _exact_joint_of_tokens_2_and_3(engine) -> torch.Tensor:
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = _ar_probs(engine, PROMPT)
    for t1 in range(VOCAB):
        if p1[t1] == 0:
            continue
        p2 = _ar_probs(engine, PROMPT + [t1])
        for t2 in range(VOCAB):
            if p2[t2] == 0:
                continue
            joint[t2] += p1[t1] * p2[t2] * _ar_probs(engine, PROMPT + [t1, t2])
    return joint  # [t2, t3]


def _sampled_joint(engine, acceptor) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    config = GenerationConfig(
        max_new_tokens=3, sampling=SAMPLING, tree="2,2,2,2", ngram_topk=0, ignore_eos=True
    )
    for run in range(SAMPLES):
        out, _ = generate(engine, PROMPT, config, random=IndependentRandom(run), acceptor=acceptor)
        counts[out[1], out[2]] += 1
    return counts


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = (probs * counts.sum()).flatten()
    observed = counts.flatten()
    big = expected >= 5  # merge small cells into one so the chi-square approximation holds
    obs = torch.cat((observed[big], observed[~big].sum()[None])).tolist()
    exp = torch.cat((expected[big], expected[~big].sum()[None])).tolist()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def test_trie_rule_matches_ar_distribution_and_row_rule_is_rejected(small_vocab_engine):
    exact = _exact_joint_of_tokens_2_and_3(small_vocab_engine)
    assert abs(float(exact.sum()) - 1) < 1e-9
    trie_p = _p_value(_sampled_joint(small_vocab_engine, accept_trie), exact)
    rows_p = _p_value(_sampled_joint(small_vocab_engine, accept_rows), exact)
    print(f"p-values: trie {trie_p:.3g}, rows {rows_p:.3g}")
    assert trie_p > 1e-3, f"lossless rule rejected (p={trie_p:.2e})"
    assert rows_p < 1e-6, f"biased rule not detected (p={rows_p:.2e})"
