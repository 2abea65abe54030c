"""Fixed-shape steps (the CUDA-graph unit): same numbers as the dynamic forward, and generate uses them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.static_step import StaticForward, bucket_for
from tokenswift_trt.decode.tree import Trie
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig

from conftest import quiet_load
from helpers import PAPER_TREE


def test_buckets():
    sizes = (1, 2, 16, 17, 41, 49, 65, 120, 129, 256, 300)
    assert [bucket_for(n) for n in sizes] == [1, 16, 16, 32, 48, 64, 96, 128, 192, 256, 300]


@pytest.mark.parametrize("kernel", ["sdpa", "tree_attention", "flash_cascade"])
def test_fixed_shape_verify_equals_dynamic_verify(llama_dir, kernel):
    directory, _ = llama_dir
    engine = quiet_load(directory)
    engine.model.use_attention_kernel(kernel)  # tree_attention: the static op with a device-side prefix
    c = engine.config
    caches = [KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 200) for _ in range(2)]
    prefix = torch.arange(5, 45)
    for cache in caches:
        engine.model(prefix, torch.arange(40), cache)
        cache.commit()
    trie = Trie(root_token=7)
    for branch in ([3, 4, 5], [3, 9], [11, 12, 13, 14]):
        trie.add_path(branch, from_tree=True)
    tokens, positions = torch.tensor(trie.tokens), torch.tensor(trie.depths) + 40
    dynamic = engine.model(tokens, positions, caches[0], tree_mask=trie.mask(), keep_queries=True)
    static = StaticForward(engine.model, caches[1], capture=False)
    fixed = static.run(tokens, positions, trie.mask())
    assert static.counters.buckets_used == {16} and static.counters.eager_runs == 1
    assert (fixed.hidden - dynamic.hidden).abs().max() <= 1e-4
    assert all((a - b).abs().max() <= 1e-4 for a, b in zip(fixed.queries, dynamic.queries))
    # the real nodes' K/V sit in the pending slots exactly as a dynamic forward leaves them
    kept = [0, 2, 3]
    for cache in caches:
        assert cache.pending == len(trie)
        cache.keep(kept)
    assert torch.allclose(caches[0].keys[:, :, :43], caches[1].keys[:, :, :43], atol=1e-4)


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(temperature=0), SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=16)]
)
@pytest.mark.parametrize(
    "method,tree,kernel",
    [
        ("tokenswift", "1,3,3,3", "sdpa"),
        ("tokenswift", "auto", "sdpa"),
        ("ar", "1,3,3,3", "sdpa"),
        ("tokenswift", "1,3,3,3", "tree_attention"),
        ("tokenswift", "1,3,3,3", "flash_cascade"),
    ],
)
def test_generate_runs_every_step_through_the_fixed_shape_path(llama_dir, sampling, method, tree, kernel):
    directory, _ = llama_dir
    engine = quiet_load(directory)
    engine.model.use_attention_kernel(kernel)
    config = GenerationConfig(
        max_new_tokens=60, method=method, sampling=sampling, tree=tree, seed=5, ignore_eos=True, kv_budget=24
    )
    dynamic, _ = generate(engine, list(range(5, 40)), replace(config, static_steps=False))
    runs = []
    fixed, stats = generate(
        engine,
        list(range(5, 40)),
        replace(config, static_steps=True),
        observer=lambda s: runs.append(s.iterations),
    )
    assert fixed == dynamic
    assert stats.iterations == runs[-1]
    # every decode forward went through the fixed-shape path: AR one per step; TokenSwift one
    # verify per iteration + one draft per iteration with a static tree (auto may choose AR steps)
    forwards = stats.iterations * (2 if method == "tokenswift" and tree != "auto" else 1)
    assert stats.fixed_shape_steps >= forwards
    assert stats.graph_replays == 0  # the engine is on the CPU: eager fixed-shape steps, never graphs


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU and a CUDA build of torch"
)
def test_cuda_graphs_are_captured_once_per_bucket_and_replayed_every_step(llama_dir):
    directory, _ = llama_dir
    engine = quiet_load(directory, device="cuda")
    config = GenerationConfig(
        tree=PAPER_TREE, max_new_tokens=80, sampling=SamplingConfig(temperature=0), seed=1, ignore_eos=True
    )
    eager, _ = generate(engine, list(range(5, 40)), replace(config, static_steps=False))
    graphed, stats = generate(engine, list(range(5, 40)), replace(config, static_steps=True))
    assert graphed == eager
    assert stats.graph_replays == stats.fixed_shape_steps >= 2 * stats.iterations
    assert 2 <= stats.graph_captures <= 8  # a few buckets for verify, one for the draft


@pytest.mark.slow  # torch.compile builds one graph per tree size: ~10 s each on 2 cores
def test_compiled_steps_generate_ars_tokens(llama_engine64):
    """--compile-steps: the fixed-shape forwards run through torch.compile (fusions change float
    rounding, so float64 keeps greedy clear of near-ties) and still give AR's tokens."""
    from torch._dynamo.utils import counters

    prompt = list(range(5, 40))
    sampling = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=16)
    base = dict(max_new_tokens=60, sampling=sampling, seed=5, ignore_eos=True)
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    graphs = counters["stats"]["unique_graphs"]
    for config in (
        GenerationConfig(**base, method="ar", compile_steps=True),
        GenerationConfig(**base, tree="1,1", ngram_topk=0, draft_source="verify", compile_steps=True),
        GenerationConfig(**base, tree="1,1", ngram_topk=0, device_loop=True, compile_steps=True),
    ):
        tokens, stats = generate(llama_engine64, prompt, config)
        assert tokens == ar
    assert counters["stats"]["unique_graphs"] > graphs  # the compiler did run
