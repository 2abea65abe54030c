"""The compiled CPU kernels (plugins_cuda/cpu/) against their PyTorch references: tree attention,
and the fused sampling step; CPU engines verifying and sampling through them."""

from __future__ import annotations

import math

import pytest
import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.linear import Linear
from tokenswift_trt.model.sampling import (
    FusedSampler,
    NoiseKeys,
    PositionKeyedRandom,
    SamplingConfig,
    draft_ranking,
    fused_sampler,
    gumbel_max_rows,
    position_gumbel,
    process_logits,
)

from conftest import quiet_load

ON, OFF = KernelConfig(cpu_kernel="on"), KernelConfig(cpu_kernel="off")


@pytest.fixture(scope="module")
def cpu_kernels():
    status = kernels.load_cpu_kernels()
    if not status.loaded:
        pytest.skip(status.reason)
    return status.module


def _tree_mask(count: int, generator: torch.Generator, blind_row: int | None = None) -> torch.Tensor:
    mask = (torch.rand(count, count, generator=generator) < 0.4).tril() | torch.eye(count, dtype=torch.bool)
    if blind_row is not None:
        mask[blind_row] = False  # with no prefix this row sees nothing: its output is 0
    return mask


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,prefix,count",
    [
        (8, 2, 32, 700, 3),  # swift-tiny's shape, one 16-row tile
        (8, 2, 32, 5000, 1),  # several key ranges per KV head, merged
        (4, 4, 64, 1500, 17),  # MHA, two tiles, tree spanning a word of the mask
        (8, 2, 128, 33, 41),  # 164 rows per KV head: 11 tiles, a partial last one
        (8, 1, 16, 2000, 5),  # group of 8: 40 rows
        (4, 2, 16, 0, 33),  # tree only, 33 nodes: mask words 0 and 1
        (9, 3, 64, 3000, 2),  # SmolLM2's shape, 6 rows (AVX2: tiles 3 + 3), ranges balanced over threads
        (6, 3, 32, 700, 4),  # 8 rows exactly: 8 lanes (AVX-512: one register tile)
        (9, 3, 64, 4096, 4),  # 12 rows: register tiles 12 (AVX-512) or 6 + 6 (AVX2), 3 KV heads, 2 threads
        (9, 3, 64, 1500, 8),  # 24 rows: AVX-512 register tiles 12 + 12 (AVX2: 6 x 4)
        (2, 1, 128, 257, 3),  # 6 rows of head_dim 128 in 8 lanes, a partial last key block
        (9, 3, 64, 4096, 1),  # an AR step of SmolLM2: 3 rows (AVX2: one row at a time)
        (9, 3, 64, 1000, 3),  # 9 rows (AVX2: register tiles 5 + 4)
        (9, 3, 64, 2049, 5),  # 15 rows (AVX-512: 16 lanes; AVX2: tiles 5 + 5 + 5), a partial last key block
        (2, 1, 128, 300, 1),  # head_dim 128 a row at a time: two passes over the values
        (4, 2, 32, 77, 1),  # head_dim 32, 2 rows (AVX2: a row at a time), a partial last key block
    ],
)
def test_kernel_equals_reference(cpu_kernels, heads, kv_heads, head_dim, prefix, count):
    generator = torch.Generator().manual_seed(prefix + count)
    query = torch.randn(heads, count, head_dim, generator=generator)
    # cache views as the runtime passes them: a slice of a larger per-layer buffer (heads strided)
    keys = torch.randn(kv_heads, prefix + count + 50, head_dim, generator=generator)[:, : prefix + count]
    values = torch.randn(kv_heads, prefix + count + 50, head_dim, generator=generator)[:, : prefix + count]
    packed = kernels.pack_tree_mask(
        _tree_mask(count, generator, blind_row=count - 1 if prefix == 0 else None)
    )
    scale = 1 / math.sqrt(head_dim)
    expected = kernels.tree_attention_reference(query, keys, values, packed, scale)
    got = cpu_kernels.tree_attention(query, keys, values, packed, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    if prefix == 0:
        assert torch.equal(got[:, -1], torch.zeros_like(got[:, -1]))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,prefix",
    [(9, 3, 64, 5268), (9, 3, 64, 1021), (8, 2, 32, 700), (2, 1, 128, 505), (8, 1, 16, 2000)],
    ids=["smollm2-5k", "smollm2-across-1024", "swift-tiny", "head-dim-128-across-512", "head-dim-16"],
)
def test_a_tree_nodes_row_is_the_ar_steps_bits(cpu_kernels, heads, kv_heads, head_dim, prefix, threads):
    """A chain node's attention in a verify is the same bits as the AR step at its position computes,
    for every tree size (register tiles) and thread count, with trees that reach past a key range's
    end (the row merges only the ranges the AR step has): otherwise, at a near-tie of two tokens'
    scores, TokenSwift's token could differ from AR's."""
    generator = torch.Generator().manual_seed(prefix)
    count = 16
    query = torch.randn(heads, count, head_dim, generator=generator)
    keys = torch.randn(kv_heads, prefix + count, head_dim, generator=generator)
    values = torch.randn(kv_heads, prefix + count, head_dim, generator=generator)
    scale = 1 / math.sqrt(head_dim)
    chain = torch.ones(count, count, dtype=torch.bool).tril()  # node t: the AR step at prefix + t
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in (0, 1, 5):
            step = cpu_kernels.tree_attention(
                query[:, t : t + 1].contiguous(),
                keys[:, : prefix + t + 1],
                values[:, : prefix + t + 1],
                kernels.pack_tree_mask(torch.ones(1, 1, dtype=torch.bool)),
                scale,
            )  # [heads, 1, head_dim]
            for size in (t + 1, t + 2, 4, 12, 16):
                if size <= t:
                    continue
                tree = cpu_kernels.tree_attention(
                    query[:, :size].contiguous(),
                    keys[:, : prefix + size],
                    values[:, : prefix + size],
                    kernels.pack_tree_mask(chain[:size, :size]),
                    scale,
                )
                assert torch.equal(tree[:, t], step[:, 0]), (t, size)
    finally:
        torch.set_num_threads(before)


def test_kernel_rejects_what_it_does_not_cover(cpu_kernels):
    query = torch.randn(4, 2, 24)
    keys = torch.randn(2, 10, 24)
    packed = kernels.pack_tree_mask(torch.ones(2, 2, dtype=torch.bool).tril())
    with pytest.raises(RuntimeError, match="head_dim 16, 32, 64 and 128"):
        cpu_kernels.tree_attention(query, keys, keys.clone(), packed, 0.2)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.tree_attention(query.double(), keys.double(), keys.double(), packed, 0.2)


def test_custom_op_on_cpu_runs_the_kernel_and_keeps_the_reference_for_the_rest(cpu_kernels):
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(8, 4, 32, generator=generator)
    keys = torch.randn(2, 300, 32, generator=generator)
    values = torch.randn(2, 300, 32, generator=generator)
    packed = kernels.pack_tree_mask(_tree_mask(4, generator))
    op = torch.ops.tokenswift.tree_attention
    torch.testing.assert_close(
        op(query, keys, values, packed, 0.17),
        kernels.tree_attention_reference(query, keys, values, packed, 0.17),
        rtol=1e-5,
        atol=2e-6,
    )
    # float64 is not the kernel's: the reference answers, exactly
    args = (query.double(), keys.double(), values.double(), packed, 0.17)
    assert torch.equal(op(*args), kernels.tree_attention_reference(*args))


def test_the_kernel_is_chosen_only_where_it_beats_sdpa(cpu_kernels, llama_dir, monkeypatch):
    # x86 vector units (8-lane tiles on AVX2, 8 or 16 on AVX-512); elsewhere SDPA
    for capability in ("AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda name=capability: name)
        assert quiet_load(llama_dir[0]).model.attention_kernel == "cpu_tree_attention"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert quiet_load(llama_dir[0]).model.attention_kernel == "sdpa"
    assert quiet_load(llama_dir[0], kernels=ON).model.attention_kernel == "cpu_tree_attention"


def test_fp32_cpu_engine_verifies_through_the_kernel_with_sdpa_logits(cpu_kernels, llama_dir):
    engine = quiet_load(llama_dir[0], kernels=ON)  # float32, head_dim 16; the kernel on any x86 CPU
    model, config = engine.model, engine.config
    assert model.attention_kernel == "cpu_tree_attention"
    generator = torch.Generator().manual_seed(5)
    prefix = 300
    tokens = torch.randint(0, config.vocab_size, (prefix,), generator=generator)
    tree = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
        dtype=torch.bool,
    )
    nodes = torch.randint(0, config.vocab_size, (5,), generator=generator)
    positions = prefix + torch.tensor([0, 1, 1, 2, 2])
    logits = {}
    for kernel in ("sdpa", "cpu_tree_attention"):
        model.use_attention_kernel(kernel)
        cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, prefix + 8)
        model(tokens, torch.arange(prefix), cache)
        cache.commit()
        logits[kernel] = model.logits(model(nodes, positions, cache, tree_mask=tree).hidden)
    torch.testing.assert_close(logits["cpu_tree_attention"], logits["sdpa"], rtol=1e-4, atol=1e-5)


def test_fp32_cpu_engine_takes_ar_steps_through_the_kernel(cpu_kernels, llama_dir):
    # one new token (an AR step) runs the kernel too: it beats SDPA there since it prefetches K/V
    engine = quiet_load(llama_dir[0], kernels=ON)
    model, config = engine.model, engine.config
    prefix = 300
    tokens = torch.randint(0, config.vocab_size, (prefix + 1,), generator=torch.Generator().manual_seed(6))
    logits = {}
    for kernel in ("sdpa", "cpu_tree_attention"):
        model.use_attention_kernel(kernel)
        cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, prefix + 8)
        model(tokens[:prefix], torch.arange(prefix), cache)
        cache.commit()
        assert model._attention_mask(1, cache, None, None, torch.device("cpu")).kernel == kernel
        logits[kernel] = model.logits(model(tokens[prefix:], torch.tensor([prefix]), cache).hidden)
    torch.testing.assert_close(logits["cpu_tree_attention"], logits["sdpa"], rtol=1e-4, atol=1e-5)


def test_cpu_kernel_can_be_turned_off(cpu_kernels, llama_dir):
    engine = quiet_load(llama_dir[0], kernels=OFF)
    assert engine.model.attention_kernel == "sdpa"
    assert engine.kernels == OFF
    packed = [m._packed for m in engine.model.modules() if isinstance(m, Linear) and m._packed is not None]
    assert all(weight.kind == "onednn" for weight in packed)  # no tiled products either
    assert engine.model.cpu_decoder is None and engine.model.screened_head is None
    assert quiet_load(llama_dir[0], dtype=torch.float64, kernels=OFF).model.attention_kernel == "sdpa"


SAMPLING_CASES = [
    SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=64),  # the paper's settings
    SamplingConfig(
        temperature=0.7, min_p=0.5, penalty=1.5, penalty_window=300
    ),  # the keep-20 floor decides the cut
    SamplingConfig(temperature=1.3),  # no truncation, no penalty
    SamplingConfig(temperature=0, penalty=1.3, penalty_window=32),  # greedy over penalised logits
]


@pytest.mark.parametrize("config", SAMPLING_CASES, ids=["paper", "keep-floor", "plain", "greedy"])
@pytest.mark.parametrize("rows,per_row_windows", [(1, False), (6, True), (6, False)])
def test_fused_sampler_equals_the_pytorch_path(cpu_kernels, config, rows, per_row_windows):
    vocab = 3000
    generator = torch.Generator().manual_seed(rows + int(config.penalty * 10))
    logits = torch.randn(rows, vocab, generator=generator) * 4  # [N, V], positive and negative logits
    # random ids (some repeat: each is penalised once) and each row's 8 best tokens, so the penalty bites
    shape = (rows, config.penalty_window) if per_row_windows else (config.penalty_window,)
    window = torch.randint(0, vocab, shape, generator=generator)
    best = logits.topk(8, dim=-1).indices  # [N, 8]
    window[..., :8] = best if per_row_windows else best[0]
    noise = (
        None
        if config.greedy
        else PositionKeyedRandom(7).gumbel_rows(list(range(100, 100 + rows)), vocab, "cpu")
    )
    sampler = fused_sampler(config, torch.device("cpu"), torch.float32)
    assert isinstance(sampler, FusedSampler)
    scores = process_logits(logits, window, config)
    expected = scores.argmax(dim=-1).tolist() if config.greedy else gumbel_max_rows(scores, noise)
    assert sampler.samples(logits, window, noise) == expected
    assert sampler.rank(logits, window, noise, 4).tolist() == draft_ranking(scores, noise, 4).tolist()
    assert (
        sampler.rank(logits, window, noise, 70).tolist() == draft_ranking(scores, noise, 70).tolist()
    )  # past the kernel's 64
    if config.penalty > 1 and per_row_windows:  # the penalty matters: without it some row's token changes
        assert sampler.samples(logits, window[..., :0], noise) != expected
    if not config.greedy:  # the same noise as keys: the kernel computes it where min-p keeps tokens
        keys = PositionKeyedRandom(7).keys(list(range(100, 100 + rows)))
        assert sampler.samples(logits, window, keys) == expected
        assert sampler.rank(logits, window, keys, 4).tolist() == draft_ranking(scores, noise, 4).tolist()
        assert sampler.rank(logits, window, keys, 70).tolist() == draft_ranking(scores, noise, 70).tolist()


def test_fused_sampler_computes_position_gumbel_from_keys(cpu_kernels):
    """Flat logits: min-p keeps every token, so the ranking is the noise's own order."""
    vocab, seed, positions = 5000, 11, [0, 7, 123_456_789]
    sampler = fused_sampler(SamplingConfig(min_p=0.1), torch.device("cpu"), torch.float32)
    assert isinstance(sampler, FusedSampler) and sampler.takes_keys
    ranked = sampler.rank(
        torch.zeros(len(positions), vocab),
        torch.zeros(0, dtype=torch.int64),
        PositionKeyedRandom(seed).keys(positions),
        64,
    )
    for row, position in zip(ranked.tolist(), positions):
        assert row == position_gumbel(seed, position, vocab).topk(64).indices.tolist()
    plain = fused_sampler(SamplingConfig(), torch.device("cpu"), torch.float32)
    assert isinstance(plain, FusedSampler) and not plain.takes_keys  # without min-p every token needs noise


def test_fused_sampler_only_where_it_has_the_semantics(cpu_kernels, monkeypatch):
    cpu = torch.device("cpu")
    assert fused_sampler(SamplingConfig(min_p=0.1), cpu, torch.float32) is not None
    for config in (SamplingConfig(top_k=40), SamplingConfig(top_p=0.9), SamplingConfig(eta=0.01)):
        assert fused_sampler(config, cpu, torch.float32) is None  # not in the kernel: PyTorch path
    assert fused_sampler(SamplingConfig(), cpu, torch.float64) is None
    assert fused_sampler(SamplingConfig(), torch.device("meta"), torch.float32) is None
    assert fused_sampler(SamplingConfig(), cpu, torch.float32, OFF) is None


def test_cpu_engine_samples_through_the_fused_step_with_the_same_tokens(cpu_kernels, llama_dir, monkeypatch):
    engine = quiet_load(llama_dir[0])  # float32
    sampling = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=32)
    prompt = list(range(5, 45))
    calls = {"rank": 0}
    real_rank = FusedSampler.rank

    def counted(self, *args):
        calls["rank"] += 1
        calls["keys"] = calls.get("keys", 0) + isinstance(args[2], NoiseKeys)
        return real_rank(self, *args)

    monkeypatch.setattr(FusedSampler, "rank", counted)
    runs = {}
    for method in ("ar", "tokenswift"):
        config = GenerationConfig(
            max_new_tokens=48,
            sampling=sampling,
            seed=3,
            method=method,
            tree="1,2",
            draft_source="verify",
            ngram_topk=0,
            ignore_eos=True,
        )
        runs[method] = generate(engine, prompt, config)[0]
    assert calls["rank"] > 48  # every AR token and every TokenSwift iteration
    assert calls["keys"] == calls["rank"]  # under min-p the noise goes in as keys
    assert runs["tokenswift"] == runs["ar"]
    # the PyTorch path (and SDPA) gives the same tokens
    config = GenerationConfig(max_new_tokens=48, sampling=sampling, seed=3, method="ar", ignore_eos=True)
    reference_engine = quiet_load(llama_dir[0], kernels=OFF)
    assert generate(reference_engine, prompt, config)[0] == runs["ar"]
