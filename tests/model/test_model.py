"""The runtime's forward equals transformers' own models (fp32, ≤ 1e-4) for prefill, step and tree verify."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenswift_trt.decode.tree import Trie
from tokenswift_trt.model.config import ConfigError
from tokenswift_trt.model.engine import WeightsError
from tokenswift_trt.model.kv_cache import KVCache

from conftest import quiet_load
from helpers import llama_config, save_hf_model

TOLERANCE = 1e-4


def _cache(engine, capacity=256):
    c = engine.config
    return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity)


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir"])
def test_prefill_and_single_step_match_transformers(fixture, request):
    directory, hf_model = request.getfixturevalue(fixture)
    engine = quiet_load(directory)
    ids = torch.randint(
        0, engine.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    reference = _hf_logits(hf_model, ids)  # [37, V]

    cache = _cache(engine)
    out = engine.model(torch.tensor(ids[:30]), torch.arange(30), cache)
    cache.commit()
    assert (engine.model.logits(out.hidden) - reference[:30]).abs().max() <= TOLERANCE
    for position in range(30, 37):  # single-token steps over the cache
        out = engine.model(torch.tensor([ids[position]]), torch.tensor([position]), cache)
        cache.commit()
        assert (engine.model.logits(out.hidden[0]) - reference[position]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("kernel", ["sdpa", "tree_attention"])
@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir"])
def test_tree_verify_equals_causal_logits_of_every_branch(fixture, kernel, request):
    directory, hf_model = request.getfixturevalue(fixture)
    engine = quiet_load(directory)
    engine.model.use_attention_kernel(kernel)  # tree_attention: the op the CUDA path runs (reference on CPU)
    vocab = engine.config.vocab_size
    prefix = list(range(5, 25))
    trie = Trie(root_token=7)
    branches = [[3, 4, 5], [3, 9], [11, 12, 13, 14], [3, 4, 6]]
    for branch in branches:
        trie.add_path(branch, from_tree=True)
    assert len(trie) == 1 + 9  # shared prefixes are merged (13 tokens -> 9 nodes)
    cache = _cache(engine)
    engine.model(torch.tensor(prefix), torch.arange(len(prefix)), cache)
    cache.commit()
    positions = torch.tensor(trie.depths) + len(prefix)
    out = engine.model(torch.tensor(trie.tokens), positions, cache, tree_mask=trie.mask())
    logits = engine.model.logits(out.hidden)  # [N, V]
    for branch in branches:
        reference = _hf_logits(hf_model, prefix + [7] + branch)[len(prefix) :]  # root + branch rows
        node, rows = 0, [0]
        for token in branch:
            node = trie.children[node][token]
            rows.append(node)
        assert (logits[rows] - reference).abs().max() <= TOLERANCE
    assert logits.shape == (len(trie), vocab)


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="linear", factor=2.0),
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256),
    ],
)
def test_rope_scaling_variants_match_transformers(rope, tmp_path):
    hf_model = save_hf_model(llama_config(rope_scaling=rope, num_key_value_heads=4), tmp_path)  # MHA
    engine = quiet_load(tmp_path)
    ids = list(range(3, 90))
    out = engine.model(torch.tensor(ids), torch.arange(len(ids)) + 500, _cache(engine))
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None] + 500).logits[0]
    assert (engine.model.logits(out.hidden) - reference).abs().max() <= TOLERANCE


def test_missing_and_misshaped_weights_are_refused(llama_dir, tmp_path):
    directory, _ = llama_dir
    tensors = load_file(str(directory / "model.safetensors"))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())

    missing = dict(tensors)
    missing.pop("model.layers.1.mlp.up_proj.weight")
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="missing weight.*up_proj"):
        quiet_load(tmp_path)

    misshaped = dict(tensors)
    misshaped["model.norm.weight"] = torch.ones(3)
    save_file(misshaped, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model.norm.weight has shape \(3,\)"):
        quiet_load(tmp_path)


def test_unsupported_architecture_and_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        quiet_load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        quiet_load(tmp_path)


@pytest.mark.parametrize("count", [1, 5, 8, 9, 40])  # folded GQA up to 8 new tokens, SDPA's own beyond
def test_grouped_sdpa_equals_attention_with_repeated_kv_heads(count):
    from tokenswift_trt.model.decoder import GQA_FOLD_MAX_TOKENS, grouped_sdpa, sdpa_bias

    assert GQA_FOLD_MAX_TOKENS == 8
    generator = torch.Generator().manual_seed(count)
    heads, kv_heads, prefix, dim = 8, 2, 70, 16
    q = torch.randn(heads, count, dim, generator=generator)
    keys = torch.randn(kv_heads, prefix + count, dim, generator=generator)
    values = torch.randn(kv_heads, prefix + count, dim, generator=generator)
    tree = torch.rand(count, count, generator=generator) < 0.5
    mask = torch.cat(
        (torch.ones(count, prefix, dtype=torch.bool), tree | torch.eye(count, dtype=torch.bool)), dim=1
    )
    group = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0), attn_mask=mask
    )  # head h reads KV head h // group
    bias = sdpa_bias(mask, heads, kv_heads, q.dtype)
    assert bias.shape == ((group * count, prefix + count) if count <= GQA_FOLD_MAX_TOKENS else mask.shape)
    assert torch.allclose(grouped_sdpa(q, keys, values, bias), expected, atol=1e-5)
