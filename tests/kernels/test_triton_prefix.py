"""The cascade's prefix block as a Triton kernel (kernels/triton_prefix.py): through Triton's
interpreter on the CPU where Triton is installed, and compiled on a GPU where there is one."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.kernels.cascade import _flash_ranges_cpu, flash_cascade_attention, split_offsets
from tokenswift_trt.kernels.prefix_config import PREFIX_VARIANTS, default_prefix_config

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:  # Triton reads this when it is first imported
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU: its interpreter runs the kernel on CPU tensors
pytest.importorskip("triton", reason="Triton comes with CUDA builds of PyTorch; this environment has none")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(
    ON_GPU or not INTERPRETED, reason="Triton's interpreter (no GPU, Triton imported after this module)"
)


def _case(kv_heads: int, rows: int, capacity: int, prefix: int, dim: int, dtype, device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randn(kv_heads, rows, dim, generator=generator).to(device, dtype)
    keys = (torch.randn(kv_heads, capacity, dim, generator=generator) * 2).to(device, dtype)
    values = torch.randn(kv_heads, capacity, dim, generator=generator).to(device, dtype)
    keys[:, prefix:] = 1e4  # past the committed keys: junk that would dominate any softmax reading it
    return packed, keys, values


@interpreter
@pytest.mark.parametrize(
    "kv_heads,rows,capacity,prefix,splits,dim",
    [
        (2, 28, 300, 250, 3, 64),  # rows not a multiple of the row block
        (2, 130, 200, 190, 2, 64),  # two row blocks of 128
        (1, 8, 40, 3, 6, 64),  # fewer committed keys than ranges: empty ranges
        (1, 16, 64, 0, 2, 128),  # nothing committed
        (1, 12, 300, 256, 2, 64),  # ranges of whole key tiles: no partial tail
    ],
)
def test_triton_prefix_block_equals_the_flash_ranges_in_the_interpreter(
    kv_heads, rows, capacity, prefix, splits, dim
):
    from tokenswift_trt.kernels.prefix_config import PrefixConfig
    from tokenswift_trt.kernels.triton_prefix import prefix_block

    packed, keys, values = _case(kv_heads, rows, capacity, prefix, dim, torch.float32, "cpu", rows + prefix)
    offsets = split_offsets(torch.tensor(prefix), splits)
    expected_outs, expected_lses = _flash_ranges_cpu(packed, keys, values, offsets, 0.125)
    present = offsets[1:] > offsets[:-1]
    # the default launch, and others a sweep may pick (smaller row tiles, wider key tiles, each kernel)
    launches = (
        None,
        PrefixConfig(32, 128, 4, 2),
        PrefixConfig(128, 32, 8, 4),
        PrefixConfig(64, 32, 4, 3, "split"),
        PrefixConfig(128, 64, 8, 3, "split"),
        PrefixConfig(64, 32, 4, 3, "tma"),
        PrefixConfig(16, 64, 4, 2, "tma"),
    )
    for launch in launches:
        outs, lses = prefix_block(packed, keys, values, offsets, 0.125, splits, launch)
        assert outs.shape == expected_outs.shape and lses.shape == expected_lses.shape
        torch.testing.assert_close(outs[present], expected_outs[present], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lses[present], expected_lses[present], rtol=1e-5, atol=1e-5)
        assert (outs[~present] == 0).all() and (lses[~present] == float("-inf")).all()


@interpreter
def test_the_cascade_through_the_triton_prefix_equals_one_masked_attention():
    """The whole cascade with its prefix block through the kernel (interpreted) and the tail as
    PyTorch ops and as the one op: the reference tree attention over the committed keys and the tree."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, count, prefix, capacity = 8, 2, 6, 150, 180
    query = torch.randn(heads, count, 64, generator=generator)
    keys = torch.randn(kv_heads, capacity, 64, generator=generator)
    values = torch.randn(kv_heads, capacity, 64, generator=generator)
    tree = torch.eye(count, dtype=torch.bool)
    tree[1:, 0] = True  # a root and its five children
    expected = kernels.tree_attention_reference(
        query, keys[:, : prefix + count], values[:, : prefix + count], kernels.pack_tree_mask(tree), 0.125
    )
    for fused_tail in (False, True):
        got = flash_cascade_attention(
            query, keys, values, tree, torch.tensor(prefix), 0.125, 3, fused_tail, prefix_backend="triton"
        )
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # the other kernels, as the switch names them
    for backend in ("triton:64,32,4,2,split", "triton:32,32,4,2,tma"):
        got = flash_cascade_attention(
            query, keys, values, tree, torch.tensor(prefix), 0.125, 3, True, prefix_backend=backend
        )
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernel needs a CUDA GPU")
@pytest.mark.parametrize("variant", PREFIX_VARIANTS)
@pytest.mark.parametrize("count,prefix,splits", [(64, 100_000, 17), (128, 4_000, 8), (7, 2, 4)])
def test_triton_prefix_block_on_cuda_matches_fp32_and_replays_in_a_graph(count, prefix, splits, variant):
    """bf16 on the GPU against the fp32 CPU ranges (relative error <= 1e-2), a poisoned output block,
    then one captured graph replayed at a second committed length (offsets computed on the device);
    each of the block's kernels at the default tiles (`tma` only where the GPU has the accelerator)."""
    from tokenswift_trt.kernels.triton_prefix import prefix_block

    if variant == "tma" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the tensor memory accelerator comes with Hopper GPUs and later")
    launch = replace(default_prefix_config(4 * count, torch.cuda.get_device_capability()), variant=variant)

    kv_heads, rows = 8, 4 * count
    packed, keys, values = _case(kv_heads, rows, prefix + 200, prefix, 128, torch.bfloat16, "cuda", count)
    length = torch.tensor(prefix, device="cuda")

    def expected(committed: int) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = split_offsets(torch.tensor(committed), splits)
        return _flash_ranges_cpu(
            packed.float().cpu(), keys.float().cpu(), values.float().cpu(), offsets, 0.088
        )

    poison = torch.full((splits, kv_heads, rows, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    del poison  # freed: the kernel's output likely reuses the block
    outs, lses = prefix_block(packed, keys, values, split_offsets(length, splits), 0.088, splits, launch)
    want_outs, want_lses = expected(prefix)
    present = (
        split_offsets(torch.tensor(prefix), splits)[1:] > split_offsets(torch.tensor(prefix), splits)[:-1]
    )
    got = outs.float().cpu()[present]
    assert torch.isfinite(got).all()
    assert ((got - want_outs[present]).norm() / want_outs[present].norm()) <= 1e-2
    torch.testing.assert_close(lses.cpu()[present], want_lses[present].float(), rtol=1e-3, atol=1e-2)
    static_outs = torch.zeros_like(outs)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prefix_block(packed, keys, values, split_offsets(length, splits), 0.088, splits, launch)  # compiles
        with torch.cuda.graph(graph, stream=stream):
            static_outs.copy_(
                prefix_block(packed, keys, values, split_offsets(length, splits), 0.088, splits, launch)[0]
            )
    moved = max(1, prefix // 2)
    length.fill_(moved)
    graph.replay()
    torch.cuda.synchronize()
    want_outs, _ = expected(moved)
    present = split_offsets(torch.tensor(moved), splits)
    present = present[1:] > present[:-1]
    got = static_outs.float().cpu()[present]
    assert ((got - want_outs[present]).norm() / want_outs[present].norm()) <= 1e-2


def test_triton_prefix_block_refuses_offsets_that_are_not_int32():
    from tokenswift_trt.kernels.triton_prefix import prefix_block

    packed, keys, values = _case(1, 8, 64, 40, 64, torch.float32, "cpu", 3)
    offsets = split_offsets(torch.tensor(40), 2).long()  # the descriptors' kernels take 32-bit offsets only
    with pytest.raises(ValueError, match="int32 range offsets"):
        prefix_block(packed, keys, values, offsets, 0.125, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="shared-memory limits are a GPU's")
def test_a_prefix_launch_too_large_for_the_gpu_says_which_and_what_to_take():
    from tokenswift_trt.kernels.prefix_config import PrefixConfig
    from tokenswift_trt.kernels.triton_prefix import prefix_block

    packed, keys, values = _case(8, 256, 4096, 4000, 128, torch.bfloat16, "cuda", 4)
    offsets = split_offsets(torch.tensor(4000, device="cuda"), 4)
    too_large = PrefixConfig(128, 128, 8, 6)  # ~430 KB of shared memory: more than any GPU has
    with pytest.raises(ValueError, match="does not fit this GPU.*smaller BLOCK_N or fewer stages"):
        prefix_block(packed, keys, values, offsets, 0.088, 4, too_large)
