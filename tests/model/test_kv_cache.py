from __future__ import annotations

import pytest
import torch

from tokenswift_trt.model.kv_cache import CacheFullError, KVCache, PartialKVCache, kv_importance_select
from tokenswift_trt.model.linear import tiled_kernels

from helpers import huge_page_kib, huge_pages_granted


def _filled(length: int, layers: int = 2, heads: int = 2, dim: int = 4, seed: int = 0) -> KVCache:
    cache = KVCache(layers, heads, dim, capacity=length + 16)
    generator = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        cache.attend_kv(
            layer,
            torch.randn(heads, length, dim, generator=generator),
            torch.randn(heads, length, dim, generator=generator),
        )
    cache.commit()
    return cache


def test_keep_compacts_pending_slots_after_the_committed_ones():
    cache = KVCache(1, 1, 2, capacity=10)
    cache.attend_kv(0, torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))
    cache.commit()
    new = torch.arange(10.0).reshape(1, 5, 2)
    keys, _ = cache.attend_kv(0, new, new + 100)
    assert keys.shape == (1, 8, 2) and cache.pending == 5
    cache.keep([0, 2, 4])
    assert cache.length == 6
    assert cache.keys[0, 0, 3:6].tolist() == [[0, 1], [4, 5], [8, 9]]
    assert cache.values[0, 0, 3:6, 0].tolist() == [100, 104, 108]
    cache.rollback(2)
    assert cache.length == 4


def test_capacity_overflow_raises():
    cache = KVCache(1, 1, 2, capacity=4)
    with pytest.raises(CacheFullError):
        cache.attend_kv(0, torch.zeros(1, 5, 2), torch.zeros(1, 5, 2))


def test_importance_selection_equals_direct_top_k_with_sinks():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 100, 8, generator=generator)  # 2 KV heads
    query = torch.randn(4, 8, generator=generator)  # 4 query heads: groups (0,1) and (2,3)
    chosen = kv_importance_select(keys, query, keep=20, sinks=4)
    for head in range(2):
        group = query[2 * head] + query[2 * head + 1]
        scores = (keys[head] @ group).tolist()
        others = sorted(range(4, 100), key=lambda i: -scores[i])[:16]
        assert chosen[head].tolist() == sorted([0, 1, 2, 3] + others)


def test_partial_cache_mirrors_small_contexts_then_selects_and_reselects():
    full = _filled(20)
    partial = PartialKVCache(2, 2, 4, budget=32, sinks=2, recent=8)
    queries = [torch.randn(2, 4), torch.randn(2, 4)]
    partial.select(full, queries)
    assert partial.length == 20 and partial.selections == 0  # fits: a plain copy
    assert torch.equal(partial.keys[:, :, :20], full.keys[:, :, :20])

    bigger = _filled(40, seed=1)
    partial.select(bigger, queries)
    assert partial.length == 24 and partial.selections == 1  # budget 32 - recent 8
    for layer in range(2):
        index = kv_importance_select(bigger.keys[layer, :, :40], queries[layer], 24, 2)
        assert torch.equal(partial.positions[layer, :, :24], index)
        for head in range(2):
            assert torch.equal(partial.keys[layer, head, :24], bigger.keys[layer, head, index[head]])

    partial.append_from(bigger, 36, 4, queries)  # recent region: appended in place
    assert partial.length == 28 and partial.positions[0, 0, 24:28].tolist() == [36, 37, 38, 39]
    partial.append_from(bigger, 36, 4, queries)
    partial.append_from(bigger, 36, 4, queries)  # would overflow 32: reselect
    assert partial.length == 24 and partial.selections == 2


@pytest.mark.skipif(tiled_kernels() is None, reason="the CPU kernels need x86 AVX2 and a C++ compiler")
def test_a_cpu_cache_starts_zeroed_on_a_huge_page_and_gets_them_as_it_fills():
    cache = KVCache(4, 3, 64, 4096)  # 12 MB each for keys and values
    for tensor in (cache.keys, cache.values):
        assert tensor.data_ptr() % (2 << 20) == 0 and tensor.is_contiguous()
        assert not tensor.any()
    cache.attend_kv(0, torch.ones(3, 4096, 64), torch.ones(3, 4096, 64))
    assert cache.keys[0].sum() == 3 * 4096 * 64 and not cache.keys[1:].any()
    if huge_pages_granted():
        assert huge_page_kib(cache.keys.data_ptr()) >= 2048
    small = KVCache(2, 2, 8, 16)  # under 2 MB: ordinary zeros
    assert small.keys.shape == (2, 2, 16, 8) and not small.keys.any()
