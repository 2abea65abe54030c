"""One pool of KV pages (model/paged_cache.py): a request's positions land in its own pages, read back
in order, a verified tree's accepted nodes move into place as the contiguous cache keeps them, and every
page goes back to the pool when the request ends; the batch's paged attention (its PyTorch reference)
is each request's own tree attention."""

from __future__ import annotations

import pytest
import torch

from tokenswift_trt.kernels.ops import paged_tree_attention_reference, tree_attention_reference
from tokenswift_trt.kernels.tree_mask import pack_tree_mask
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.paged_cache import PagedSequence, PagePool, PagePoolFull

from helpers import PAGED_HEAD_DIM as HEAD_DIM
from helpers import PAGED_KV_HEADS as KV_HEADS
from helpers import PAGED_PAGE as PAGE
from helpers import paged_batch

LAYERS = 2


def _pool(pages: int = 32) -> PagePool:
    return PagePool(LAYERS, KV_HEADS, HEAD_DIM, pages, PAGE, torch.float32)


def _fill(sequence: PagedSequence, cache: KVCache, count: int, generator: torch.Generator, commit=True):
    """`count` new positions of random K/V into both, every layer."""
    sequence.reserve(count)
    for layer in range(LAYERS):
        keys = torch.randn(KV_HEADS, count, HEAD_DIM, generator=generator)
        values = torch.randn(KV_HEADS, count, HEAD_DIM, generator=generator)
        sequence.write(layer, keys, values)
        cache.attend_kv(layer, keys, values)
    if commit:
        sequence.commit()
        cache.commit()


def test_positions_read_back_in_order_and_pages_go_back_to_the_pool():
    pool, generator = _pool(), torch.Generator().manual_seed(0)
    first, second = PagedSequence(pool), PagedSequence(pool)
    caches = [KVCache(LAYERS, KV_HEADS, HEAD_DIM, 64) for _ in range(2)]
    for step in (7, 1, 1, 5, 2):  # the two requests' pages interleave in the pool
        _fill(first, caches[0], step, generator)
        _fill(second, caches[1], step + 1, generator)
    assert len(first.pages) == -(-16 // PAGE) and len(second.pages) == -(-21 // PAGE)
    assert not set(first.pages) & set(second.pages)
    assert pool.free_pages == 32 - len(first.pages) - len(second.pages)
    for sequence, cache in zip((first, second), caches):
        for layer in range(LAYERS):
            keys, values = sequence.gather(layer)
            assert torch.equal(keys, cache.keys[layer, :, : cache.length])
            assert torch.equal(values, cache.values[layer, :, : cache.length])
    first.release()
    second.release()
    assert pool.free_pages == 32 and first.pages == [] and first.length == 0


def test_keep_moves_the_accepted_nodes_as_the_contiguous_cache_does():
    pool, generator = _pool(), torch.Generator().manual_seed(1)
    sequence, cache = PagedSequence(pool), KVCache(LAYERS, KV_HEADS, HEAD_DIM, 64)
    _fill(sequence, cache, 6, generator)
    _fill(sequence, cache, 9, generator, commit=False)  # a tree of 9 nodes, crossing pages
    sequence.keep([0, 3, 4, 8])
    cache.keep(torch.tensor([0, 3, 4, 8]))
    assert sequence.length == cache.length == 10
    for layer in range(LAYERS):
        keys, values = sequence.gather(layer)
        assert torch.equal(keys, cache.keys[layer, :, :10]) and torch.equal(
            values, cache.values[layer, :, :10]
        )


def test_a_full_pool_refuses_without_taking_anything():
    pool = _pool(pages=3)
    sequence = PagedSequence(pool)
    sequence.reserve(2 * PAGE)
    with pytest.raises(PagePoolFull, match="2 KV pages needed, 1 free"):
        PagedSequence(pool).reserve(2 * PAGE)
    assert pool.free_pages == 1
    assert PagePool.pages_for(2**20, LAYERS, KV_HEADS, HEAD_DIM, PAGE, torch.float32) == 2**20 // (
        2 * LAYERS * KV_HEADS * PAGE * HEAD_DIM * 4
    )


def test_the_paged_reference_is_each_requests_own_tree_attention():
    query, pool, tables, prefixes, counts, words, requests = paged_batch(torch.Generator().manual_seed(2))
    out = paged_tree_attention_reference(
        query, pool.keys[0], pool.values[0], tables, prefixes, counts, words, 0.3
    )
    first = 0
    for sequence, mask in requests:
        count = mask.shape[0]
        keys, values = sequence.gather(0)
        own = tree_attention_reference(
            query[first : first + count].transpose(0, 1), keys, values, pack_tree_mask(mask), 0.3
        )
        torch.testing.assert_close(out[first : first + count], own.transpose(0, 1), rtol=1e-6, atol=1e-6)
        first += count
