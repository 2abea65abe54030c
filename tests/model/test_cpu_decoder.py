"""The compiled CPU decoder stack (model/cpu_decoder.py) computes what the layers' PyTorch code does."""

from __future__ import annotations

import pytest
import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.tree import Trie
from tokenswift_trt.model.kv_cache import KVCache, PartialKVCache
from tokenswift_trt.model.linear import TILED_MAX_ROWS, tiled_kernels
from tokenswift_trt.model.sampling import SamplingConfig

from conftest import quiet_load

pytestmark = pytest.mark.skipif(
    tiled_kernels() is None, reason="the compiled decoder needs the tiled kernel (x86 AVX2 CPU, C++ compiler)"
)


def _tree(count: int, seed: int) -> Trie:
    generator = torch.Generator().manual_seed(seed)
    trie = Trie(5)
    while len(trie) < count:
        depth = int(torch.randint(1, 4, (1,), generator=generator))
        trie.add_path(torch.randint(0, 90, (depth,), generator=generator).tolist(), from_tree=True)
    return trie


def _forward(model, cache, tokens, positions, mask, compiled: bool):
    saved = model.cpu_decoder
    model.cpu_decoder = saved if compiled else None
    try:
        out = model(tokens, positions, cache, tree_mask=mask, keep_queries=True)
    finally:
        model.cpu_decoder = saved
    new_keys = cache.keys[:, :, cache.length : cache.length + cache.pending].clone()
    new_values = cache.values[:, :, cache.length : cache.length + cache.pending].clone()
    cache.pending = 0
    return out, new_keys, new_values


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir"])  # Qwen2: Q/K/V biases, MHA-free GQA
@pytest.mark.parametrize("kernel", ["sdpa", "cpu_tree_attention"])
def test_the_compiled_stack_equals_the_layers_own_code(request, fixture, kernel):
    engine = quiet_load(request.getfixturevalue(fixture)[0])
    model, config = engine.model, engine.config
    assert model.cpu_decoder is not None
    model.use_attention_kernel(kernel)
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 120)
    with torch.inference_mode():
        model(torch.arange(3, 43), torch.arange(40), cache)
    cache.commit()
    # SDPA folds the query heads up to 8 tokens, not beyond; 40 and 80: tries with a long match's branch
    for count in (1, 3, 9, 16, 40, 80):
        trie = _tree(count, seed=count)
        tokens, positions = torch.tensor(trie.tokens[:count]), torch.tensor(trie.depths[:count]) + 40
        mask = trie.mask()[:count, :count]
        compiled, keys, values = _forward(model, cache, tokens, positions, mask, compiled=True)
        plain, plain_keys, plain_values = _forward(model, cache, tokens, positions, mask, compiled=False)
        assert torch.allclose(compiled.hidden, plain.hidden, atol=1e-4, rtol=1e-4), count
        assert torch.allclose(keys, plain_keys, atol=1e-5) and torch.allclose(values, plain_values, atol=1e-5)
        for ours, theirs in zip(compiled.queries, plain.queries, strict=True):
            assert ours.shape == theirs.shape == (count, config.num_heads, config.head_dim)
            assert torch.allclose(ours, theirs, atol=1e-5)
        assert cache.length == 40


def test_the_compiled_stack_is_left_for_changed_weights_partial_caches_and_prompts(llama_dir):
    engine = quiet_load(llama_dir[0])
    model, config = engine.model, engine.config
    decoder = model.cpu_decoder
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 64)
    partial = PartialKVCache(config.num_layers, config.num_kv_heads, config.head_dim, 32)
    with torch.inference_mode():
        assert decoder.usable(TILED_MAX_ROWS, cache)  # every verify trie
        assert not decoder.usable(
            TILED_MAX_ROWS + 1, cache
        )  # a prompt's chunk: PyTorch's product is faster there
        assert not decoder.usable(1, partial)
    assert not decoder.usable(1, cache)  # outside inference mode (training, export)
    tokens = torch.arange(5, 9)
    before = model.logits(model(tokens, torch.arange(4), cache).hidden)
    cache.pending = 0
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(0.5)  # in place: the packed copy is stale
    with torch.inference_mode():
        assert not decoder.usable(1, cache)
    after = model.logits(model(tokens, torch.arange(4), cache).hidden)
    cache.pending = 0
    model.cpu_decoder = None
    assert torch.equal(
        after, model.logits(model(tokens, torch.arange(4), cache).hidden)
    )  # PyTorch's code ran
    assert not torch.allclose(before, after)
    model.pack()  # a new stack for the new weights; then a weight replaced outright is noticed too
    with torch.inference_mode():
        assert model.cpu_decoder is not None and model.cpu_decoder.usable(1, cache)
        gate = model.model.layers[0].mlp.gate_proj
        gate.weight = torch.nn.Parameter(gate.weight.detach().clone())
        assert not model.cpu_decoder.usable(1, cache)


def test_tokens_through_the_compiled_stack_equal_ar(llama_dir):
    """Greedy and seeded sampling: TokenSwift's tokens equal AR's, both on the compiled stack."""
    engine = quiet_load(llama_dir[0])
    prompt = list(range(3, 40))
    for sampling in (
        SamplingConfig(temperature=0.0),
        SamplingConfig(temperature=1.0, min_p=0.05, penalty=1.2),
    ):
        settings = dict(max_new_tokens=60, sampling=sampling, seed=7, ignore_eos=True)
        ar = generate(engine, prompt, GenerationConfig(**settings, method="ar"))[0]
        swift = generate(engine, prompt, GenerationConfig(**settings, tree="3,2", draft_source="verify"))[0]
        assert swift == ar
