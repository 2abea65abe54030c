"""The CUDA kernels against the PyTorch references on fresh random inputs (GPU machines only)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenswift_trt.kernels import ops as kernels

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch"
)


@pytest.fixture(scope="module")
def cuda_module():
    status = kernels.load_cuda_kernels()
    if not status.loaded:
        pytest.fail(f"a GPU is present but the kernels did not build: {status.reason}")
    return status.module


def _random_tree_mask(count: int, generator: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, count)]
    mask = torch.zeros(count, count, dtype=torch.bool)
    for node in range(count):
        walk = node
        while walk >= 0:
            mask[node, walk] = True
            walk = parents[walk]
    return mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
# query rows per KV head (G x T): 4, 256, 128, 1792, 74; 287 (a two-tile block with idle warps),
# 192 and 384 (the 48 and 96 buckets)
@pytest.mark.parametrize(
    "heads,kv_heads,count,prefix",
    [
        (32, 8, 1, 4000),
        (32, 8, 64, 9000),
        (8, 8, 128, 777),
        (28, 4, 256, 33000),
        (4, 2, 37, 0),
        (28, 4, 41, 5000),
        (32, 8, 48, 3000),
        (32, 8, 96, 2000),
    ],
)
def test_tree_attention_matches_reference(cuda_module, dtype, head_dim, heads, kv_heads, count, prefix):
    generator = torch.Generator().manual_seed(count + prefix + head_dim)
    capacity = prefix + count + 100  # strided cache view, as the runtime passes it
    cache_k = torch.randn(kv_heads, capacity, head_dim, generator=generator).to("cuda", dtype)
    cache_v = torch.randn(kv_heads, capacity, head_dim, generator=generator).to("cuda", dtype)
    keys, values = cache_k[:, : prefix + count], cache_v[:, : prefix + count]
    query = torch.randn(heads, count, head_dim, generator=generator).to("cuda", dtype)
    packed = kernels.pack_tree_mask(_random_tree_mask(count, generator)).cuda()
    scale = 1 / math.sqrt(head_dim)
    output = torch.full_like(query, float("nan"))
    cuda_module.tree_attention_into(query, keys, values, packed, scale, output)
    assert not output.isnan().any(), "every output element is written"
    reference = kernels.tree_attention_reference(query, keys, values, packed, scale).float()
    error = (output.float() - reference).norm() / reference.norm()
    assert error <= 1e-2
    assert torch.equal(torch.ops.tokenswift.tree_attention(query, keys, values, packed, scale), output)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "length,keep,sinks",
    [(5000, 1024, 16), (131072, 4096, 16), (300, 200, 4), (300, 300, 4), (1000, 10, 16), (64, 16, 16)],
)
def test_kv_importance_select_matches_reference(cuda_module, dtype, length, keep, sinks):
    generator = torch.Generator().manual_seed(length + keep)
    head_dim, kv_heads, heads = 128, 8, 32
    cache_k = torch.randn(kv_heads, length + 64, head_dim, generator=generator).to("cuda", dtype)
    cache_v = torch.randn(kv_heads, length + 64, head_dim, generator=generator).to("cuda", dtype)
    keys, values = cache_k[:, :length], cache_v[:, :length]
    query = torch.randn(heads, head_dim, generator=generator).to("cuda", dtype)
    chosen = kernels.kv_importance_select(keys, query, keep, sinks)
    # scores tie rarely in fp32; compare with the reference computed from the same rounded inputs
    expected = kernels.kv_importance_select_reference(keys, query, keep, sinks)
    assert chosen.shape == expected.shape
    overlap = (chosen[:, :, None] == expected[:, None, :]).any(dim=2).float().mean()
    assert overlap >= 0.999 and torch.all(chosen[:, 1:] > chosen[:, :-1])
    assert torch.equal(
        chosen[:, : min(sinks, keep)].cpu(), torch.arange(min(sinks, keep)).expand(kv_heads, -1)
    )
    if keep < length:
        out_k = torch.full((kv_heads, keep + 8, head_dim), float("nan"), device="cuda", dtype=dtype)
        out_v = torch.full_like(out_k, float("nan"))
        gathered = cuda_module.kv_importance_select_gather(keys, values, query, keep, sinks, out_k, out_v)
        assert torch.equal(gathered, chosen)
        index = chosen[:, :, None].expand(-1, -1, head_dim)
        assert torch.equal(out_k[:, :keep], torch.gather(keys, 1, index))
        assert torch.equal(out_v[:, :keep], torch.gather(values, 1, index))


@pytest.mark.parametrize("prefix", [0, 700, 20000])
def test_static_tree_attention_reads_the_prefix_length_on_the_device(cuda_module, prefix):
    generator = torch.Generator().manual_seed(prefix)
    heads, kv_heads, count, head_dim, capacity = 32, 8, 16, 128, 24000
    keys = torch.randn(kv_heads, capacity, head_dim, generator=generator).to("cuda", torch.bfloat16)
    values = torch.randn(kv_heads, capacity, head_dim, generator=generator).to("cuda", torch.bfloat16)
    query = torch.randn(heads, count, head_dim, generator=generator).to("cuda", torch.bfloat16)
    packed = kernels.pack_tree_mask(_random_tree_mask(count, generator)).cuda()
    length = torch.tensor(prefix, dtype=torch.int32, device="cuda")
    static = kernels.tree_attention_static(query, keys, values, packed, length, 0.088)
    sliced = kernels.tree_attention(
        query, keys[:, : prefix + count], values[:, : prefix + count], packed, 0.088
    )
    reference = kernels.tree_attention_reference(
        query, keys[:, : prefix + count], values[:, : prefix + count], packed, 0.088
    ).float()
    assert (static.float() - reference).norm() / reference.norm() <= 1e-2
    assert (static.float() - sliced.float()).abs().max() <= 2e-2  # split counts differ (capacity vs length)


def test_kv_importance_select_ties_and_signed_zeros_match_exactly(cuda_module):
    """Small-integer keys make the fp32 scores exact: many ties (and -0 vs +0) must resolve by position."""
    generator = torch.Generator().manual_seed(11)
    keys = torch.randint(-2, 3, (4, 3000, 64), generator=generator).float()
    keys[:, ::7] = 0.0
    keys[:, 3::11] = -0.0
    query = torch.randint(-1, 2, (8, 64), generator=generator).float()
    for dtype in (torch.bfloat16, torch.float16):
        k, q = keys.to("cuda", dtype), query.to("cuda", dtype)
        for keep, sinks in ((500, 16), (2999, 4), (17, 16)):
            chosen = kernels.kv_importance_select(k, q, keep, sinks)
            assert torch.equal(
                chosen.cpu(), kernels.kv_importance_select_reference(k.cpu(), q.cpu(), keep, sinks)
            )
