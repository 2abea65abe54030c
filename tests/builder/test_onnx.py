"""ONNX backend: onnxruntime equals the torch forward (fp32, ≤ 1e-4) and decodes the same tokens."""

from __future__ import annotations

import pytest
import torch

from tokenswift_trt.backends.onnx_backend import OnnxDecoder
from tokenswift_trt.builder.onnx_export import export_onnx
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.tree import Trie
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig

from conftest import quiet_load
from helpers import PAPER_TREE

pytest.importorskip("onnxruntime", reason="the onnx backend needs onnxruntime")
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["llama_dir", "qwen2_dir"])
def engines(request, tmp_path_factory):
    directory, _ = request.getfixturevalue(request.param)
    torch_engine = quiet_load(directory)
    onnx_dir = tmp_path_factory.mktemp("onnx")
    export_onnx(torch_engine.model, torch_engine.draft_layers, onnx_dir)
    onnx_engine = quiet_load(directory)
    onnx_engine.model = OnnxDecoder(onnx_engine.model, onnx_dir)
    return torch_engine, onnx_engine


def _cache(engine):
    c = engine.config
    return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 128)


def test_prefill_verify_and_draft_match_torch(engines):
    torch_engine, onnx_engine = engines
    prompt = torch.arange(5, 25)
    caches = [_cache(torch_engine), _cache(onnx_engine)]
    outs = [e.model(prompt, torch.arange(20), c, keep_queries=True) for e, c in zip(engines, caches)]
    for cache in caches:
        cache.commit()
    assert (
        torch_engine.model.logits(outs[0].hidden) - onnx_engine.model.logits(outs[1].hidden)
    ).abs().max() <= TOLERANCE
    assert all((a - b).abs().max() <= TOLERANCE for a, b in zip(outs[0].queries, outs[1].queries))
    assert (caches[0].keys[:, :, :20] - caches[1].keys[:, :, :20]).abs().max() <= TOLERANCE

    trie = Trie(7)
    for branch in ([3, 4, 5], [3, 9], [11, 12, 13, 14]):
        trie.add_path(branch, from_tree=True)
    tokens, positions = torch.tensor(trie.tokens), torch.tensor(trie.depths) + 20
    verified = [e.model(tokens, positions, c, tree_mask=trie.mask()) for e, c in zip(engines, caches)]
    logits = [e.model.logits(v.hidden) for e, v in zip(engines, verified)]
    assert (logits[0] - logits[1]).abs().max() <= TOLERANCE
    assert (
        caches[0].keys[:, :, 20 : 20 + len(trie)] - caches[1].keys[:, :, 20 : 20 + len(trie)]
    ).abs().max() <= TOLERANCE

    drafts = [
        e.model.draft(torch.tensor([7]), torch.tensor([20]), c, e.draft_layers)
        for e, c in zip(engines, caches)
    ]
    assert drafts[0].shape == (4, torch_engine.config.vocab_size)
    assert (drafts[0] - drafts[1]).abs().max() <= TOLERANCE


def test_greedy_tokenswift_through_onnx_equals_torch(engines):
    torch_engine, onnx_engine = engines
    prompt = list(range(3, 40))
    config = GenerationConfig(
        tree=PAPER_TREE,
        max_new_tokens=80,
        sampling=SamplingConfig(temperature=0),
        ignore_eos=True,
        kv_budget=32,
    )
    swift_torch, _ = generate(torch_engine, prompt, config)
    swift_onnx, stats = generate(onnx_engine, prompt, config)
    assert swift_onnx == swift_torch and stats.partial_selections > 0
