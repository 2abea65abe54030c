"""The kernels' PyTorch references and custom ops against naive formulas and hand-made cases."""

from __future__ import annotations

import math

import pytest
import torch

from tokenswift_trt.kernels import ops as kernels


def test_packed_tree_mask_uses_bit_j_mod_32_of_word_j_div_32():
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    assert kernels.pack_tree_mask(causal).tolist() == [[1], [3], [7]]

    mask = torch.zeros(40, 40, dtype=torch.bool)
    mask[5, 0] = mask[5, 31] = mask[5, 33] = True
    packed = kernels.pack_tree_mask(mask)
    assert packed.shape == (40, 2) and packed.dtype == torch.int32
    assert packed[5, 0].item() == 1 - 2**31  # bits 0 and 31: 0x80000001 read as int32
    assert packed[5, 1].item() == 2  # node 33 is bit 1 of word 1
    assert packed[4].tolist() == [0, 0]

    random_mask = torch.rand(70, 70, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(kernels.unpack_tree_mask(kernels.pack_tree_mask(random_mask), 70), random_mask)


def _naive_tree_attention(query, keys, values, mask_bool, scale):
    """Loops over heads, nodes and keys; explicit softmax."""
    heads, count, head_dim = query.shape
    kv_heads, key_length, _ = keys.shape
    prefix = key_length - count
    out = torch.zeros(heads, count, head_dim, dtype=torch.float64)
    for head in range(heads):
        kv = head // (heads // kv_heads)
        for node in range(count):
            visible = [j for j in range(key_length) if j < prefix or mask_bool[node, j - prefix]]
            logits = [float(query[head, node].double() @ keys[kv, j].double()) * scale for j in visible]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            for weight, j in zip(weights, visible):
                out[head, node] += weight / total * values[kv, j].double()
    return out


@pytest.mark.parametrize("heads,kv_heads,count,prefix", [(4, 2, 5, 9), (6, 2, 37, 3), (2, 2, 1, 12)])
def test_tree_attention_reference_equals_naive_formula(heads, kv_heads, count, prefix):
    generator = torch.Generator().manual_seed(heads * 100 + count)
    head_dim = 8
    query = torch.randn(heads, count, head_dim, generator=generator)
    keys = torch.randn(kv_heads, prefix + count, head_dim, generator=generator)
    values = torch.randn(kv_heads, prefix + count, head_dim, generator=generator)
    mask = (torch.rand(count, count, generator=generator) < 0.4).tril()
    mask |= torch.eye(count, dtype=torch.bool)  # every node sees itself
    scale = 1 / math.sqrt(head_dim)
    expected = _naive_tree_attention(query, keys, values, mask, scale)
    packed = kernels.pack_tree_mask(mask)
    reference = kernels.tree_attention_reference(query, keys, values, packed, scale)
    assert (reference.double() - expected).abs().max() < 1e-5
    through_op = torch.ops.tokenswift.tree_attention(
        query, keys, values, packed, scale
    )  # the custom op on CPU
    assert torch.equal(through_op, reference)


def test_tree_attention_reference_reads_strided_cache_views():
    """The runtime passes cache slices [kv_heads, L, head_dim] whose heads are `capacity` rows apart."""
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 50, 16, generator=generator)  # capacity 50
    keys, values = cache[:, :20], cache[:, :20] * 0.5
    query = torch.randn(4, 4, 16, generator=generator)
    packed = kernels.pack_tree_mask(torch.ones(4, 4, dtype=torch.bool).tril())
    out = kernels.tree_attention_reference(query, keys, values, packed, 0.25)
    dense = kernels.tree_attention_reference(query, keys.contiguous(), values.contiguous(), packed, 0.25)
    assert torch.equal(out, dense)


def _naive_select(keys, query, keep, sinks):
    kv_heads, length, head_dim = keys.shape
    group = query.shape[0] // kv_heads
    result = []
    for head in range(kv_heads):
        scores = []
        for position in range(length):
            score = sum(float(query[head * group + g] @ keys[head, position]) for g in range(group))
            scores.append((-score, position))  # best first, then lower position
        others = sorted(scores[sinks:])[: keep - sinks]
        result.append(sorted(list(range(sinks)) + [position for _, position in others]))
    return result


def test_kv_importance_select_reference_equals_naive_selection():
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 60, 8, generator=generator)
    query = torch.randn(6, 8, generator=generator)  # GQA: 3 query heads per KV head
    chosen = kernels.kv_importance_select(keys, query, 20, 4)
    assert chosen.dtype == torch.int64 and chosen.tolist() == _naive_select(keys, query, 20, 4)


def test_kv_importance_select_breaks_ties_by_lower_position_and_keeps_sinks():
    keys = torch.zeros(1, 12, 4)
    keys[0, :, 0] = torch.tensor([0, 0, 5, 1, 3, 3, 3, 3, 9, 0, 3, 2], dtype=torch.float32)
    query = torch.tensor([[1.0, 0, 0, 0]])
    # sinks 0,1 (scores 0); then best: 9 (pos 8), 5 (pos 2), then the score-3 tie: positions 4, 5
    assert kernels.kv_importance_select(keys, query, 6, 2).tolist() == [[0, 1, 2, 4, 5, 8]]
    assert kernels.kv_importance_select(keys, query, 20, 2).tolist() == [list(range(12))]  # keep >= length


def test_ops_have_shapes_for_tracing():
    """Fake (meta) implementations let torch.export / the ONNX exporter trace through the ops."""

    class Attend(torch.nn.Module):
        def forward(self, query, keys, values, mask):
            return torch.ops.tokenswift.tree_attention(query, keys, values, mask, 0.5)

    args = (
        torch.randn(4, 3, 8),
        torch.randn(2, 10, 8),
        torch.randn(2, 10, 8),
        kernels.pack_tree_mask(torch.ones(3, 3, dtype=torch.bool).tril()),
    )
    program = torch.export.export(Attend(), args)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert "tokenswift.tree_attention.default" in targets


def test_the_cuda_implementation_routes_what_the_kernel_does_not_cover_to_the_reference():
    calls = []

    def kernel(*args):
        calls.append("kernel")
        return args[0]

    def reference(*args):
        calls.append("reference")
        return args[0]

    run = kernels.kernel_or_reference(kernel, reference)
    run(torch.zeros(2, 3, 64, dtype=torch.bfloat16), 1.0)
    run(torch.zeros(2, 3, 128, dtype=torch.float16), 1.0)
    run(torch.zeros(2, 3, 64, dtype=torch.float32), 1.0)  # element type the kernel lacks
    run(torch.zeros(2, 3, 32, dtype=torch.bfloat16), 1.0)  # head size the kernel lacks
    assert calls == ["kernel", "kernel", "reference", "reference"]
