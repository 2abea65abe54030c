"""The compiled CPU tree-attention kernel (plugins_cuda/cpu/tree_attention_cpu.cpp) against the
PyTorch reference, and CPU engines verifying through it."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import quiet_load
from tokenswift_trt.runtime import kernels
from tokenswift_trt.runtime.kv_cache import KVCache


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
    ],
)
def test_kernel_equals_reference(cpu_kernels, heads, kv_heads, head_dim, prefix, count):
    generator = torch.Generator().manual_seed(prefix + count)
    query = torch.randn(heads, count, head_dim, generator=generator)
    # cache views as the runtime passes them: a slice of a larger per-layer buffer (heads strided)
    keys = torch.randn(kv_heads, prefix + count + 50, head_dim, generator=generator)[:, : prefix + count]
    values = torch.randn(kv_heads, prefix + count + 50, head_dim, generator=generator)[:, : prefix + count]
    packed = kernels.pack_tree_mask(_tree_mask(count, generator, blind_row=count - 1 if prefix == 0 else None))
    scale = 1 / math.sqrt(head_dim)
    expected = kernels.tree_attention_reference(query, keys, values, packed, scale)
    got = cpu_kernels.tree_attention(query, keys, values, packed, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
    if prefix == 0:
        assert torch.equal(got[:, -1], torch.zeros_like(got[:, -1]))


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
    torch.testing.assert_close(op(query, keys, values, packed, 0.17),
                               kernels.tree_attention_reference(query, keys, values, packed, 0.17), rtol=1e-5, atol=2e-6)
    # float64 is not the kernel's: the reference answers, exactly
    args = (query.double(), keys.double(), values.double(), packed, 0.17)
    assert torch.equal(op(*args), kernels.tree_attention_reference(*args))


def test_fp32_cpu_engine_verifies_through_the_kernel_with_sdpa_logits(cpu_kernels, llama_dir):
    engine = quiet_load(llama_dir[0])  # float32, head_dim 16
    model, config = engine.model, engine.config
    assert model.attention_kernel == "cpu_tree_attention"
    generator = torch.Generator().manual_seed(5)
    prefix = 300
    tokens = torch.randint(0, config.vocab_size, (prefix,), generator=generator)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
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


def test_cpu_kernel_can_be_turned_off(cpu_kernels, llama_dir, monkeypatch):
    monkeypatch.setenv("TOKENSWIFT_CPU_KERNEL", "0")
    assert quiet_load(llama_dir[0]).model.attention_kernel == "sdpa"
    assert quiet_load(llama_dir[0], dtype=torch.float64).model.attention_kernel == "sdpa"
