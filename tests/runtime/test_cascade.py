"""Tree attention as prefix block + tree block + log-sum-exp merge (the GPU cascade's math, on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tokenswift_trt.runtime import kernels
from tokenswift_trt.runtime.cascade import (
    attend_partial,
    cascade_tree_attention,
    merge_partials,
    pack_group_rows,
    padded_tree_size,
    split_key_ranges,
    unpack_group_rows,
)


def _tree(count: int, generator: torch.Generator) -> torch.Tensor:
    """A random trie's ancestor mask: node i's parent is a random earlier node."""
    mask = torch.eye(count, dtype=torch.bool)
    for node in range(1, count):
        parent = int(torch.randint(0, node, (1,), generator=generator))
        mask[node] |= mask[parent]
    return mask


@pytest.mark.parametrize(
    "heads,kv_heads,count,prefix,splits",
    [
        (9, 3, 5, 300, 1),
        (9, 3, 41, 1000, 4),
        (4, 4, 1, 64, 3),
        (32, 8, 64, 257, 5),
        (8, 2, 7, 0, 2),  # nothing committed: the tree block alone
    ],
)
def test_cascade_equals_one_masked_attention(heads, kv_heads, count, prefix, splits):
    generator = torch.Generator().manual_seed(count + prefix)
    query = torch.randn(heads, count, 16, generator=generator, dtype=torch.float64)
    keys = torch.randn(kv_heads, prefix + count, 16, generator=generator, dtype=torch.float64)
    values = torch.randn(kv_heads, prefix + count, 16, generator=generator, dtype=torch.float64)
    packed = kernels.pack_tree_mask(_tree(count, generator))
    expected = kernels.tree_attention_reference(query, keys, values, packed, 0.25)
    got = cascade_tree_attention(query, keys, values, packed, 0.25, prefix_splits=splits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_merging_split_key_blocks_is_one_softmax():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 6, 8, generator=generator)
    keys, values = torch.randn(2, 100, 8, generator=generator), torch.randn(2, 100, 8, generator=generator)
    whole, whole_lse = attend_partial(rows, keys, values, 0.3)
    parts = [attend_partial(rows, keys[:, a:b], values[:, a:b], 0.3) for a, b in split_key_ranges(100, 7)]
    torch.testing.assert_close(merge_partials(parts), whole)
    torch.testing.assert_close(torch.logsumexp(torch.stack([lse for _, lse in parts]), 0), whole_lse)


def test_a_row_that_sees_nothing_gives_zero_and_does_not_poison_the_merge():
    rows, keys, values = torch.randn(1, 2, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    blind = torch.tensor([[False, False, False], [True, False, True]])
    out, lse = attend_partial(rows, keys, values, 1.0, blind)
    assert torch.equal(out[0, 0], torch.zeros(4)) and lse[0, 0] == float("-inf")
    merged = merge_partials([(out, lse), attend_partial(rows, keys, values, 1.0)])
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged[0, 0], attend_partial(rows, keys, values, 1.0)[0][0, 0])
    nothing = merge_partials([(out, lse), (out, lse)])
    assert torch.equal(nothing[0, 0], torch.zeros(4))


def test_group_rows_pack_heads_sharing_a_kv_head_and_unpack_exactly():
    query = torch.arange(9 * 4 * 2, dtype=torch.float32).view(9, 4, 2)
    rows = pack_group_rows(query, 3)
    assert rows.shape == (3, 12, 2)
    assert torch.equal(rows[1, 4 + 2], query[4, 2])  # KV head 1, group member 1 (head 4), node 2
    assert torch.equal(unpack_group_rows(rows, 9), query)


def test_tree_slots_round_up_to_the_row_tile_and_key_ranges_cover_the_keys():
    assert [padded_tree_size(n) for n in (1, 16, 17, 41, 64)] == [16, 16, 32, 48, 64]
    assert padded_tree_size(41, tile=64) == 64
    with pytest.raises(ValueError):
        padded_tree_size(0)
    assert split_key_ranges(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert split_key_ranges(2, 5) == [(0, 1), (1, 2)]
    assert split_key_ranges(0, 2) == [(0, 0)]
