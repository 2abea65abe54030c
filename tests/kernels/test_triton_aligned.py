"""Position-aligned attention (kernels/triton_aligned.py): equal to attention over the committed keys and
each node's path, and a node's row the same bits as an AR step's at its position. Through Triton's
interpreter on the CPU where Triton is installed, compiled on a GPU where there is one."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:  # Triton reads this when it is first imported
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU: its interpreter runs the kernels on CPU tensors
pytest.importorskip("triton", reason="Triton comes with CUDA builds of PyTorch; this environment has none")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(
    ON_GPU or not INTERPRETED, reason="Triton's interpreter (no GPU, Triton imported after this module)"
)

# a root, two children, a grandchild under the first, its child: depths 0 1 1 2 3
PARENTS = [-1, 0, 0, 1, 3]


def tree_of(parents: list[int]) -> tuple[list[int], list[list[int]]]:
    """(depths, ancestors[t] = the path root..t) of a tree given each node's parent."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    return [len(path) - 1 for path in paths], paths


def padded(paths: list[list[int]]) -> torch.Tensor:
    width = max(len(path) for path in paths)
    return torch.tensor([path + [0] * (width - len(path)) for path in paths], dtype=torch.int32)


def case(heads, kv_heads, dim, committed, count, dtype, device, seed, junk_after=None):
    generator = torch.Generator().manual_seed(seed)
    capacity = committed + count + 70
    query = torch.randn(heads, count, dim, generator=generator).to(device, dtype)
    keys = torch.randn(kv_heads, capacity, dim, generator=generator).to(device, dtype)
    values = torch.randn(kv_heads, capacity, dim, generator=generator).to(device, dtype)
    keys[:, committed:] = 1e4  # never read: junk that would dominate any softmax reading it
    values[:, committed:] = float("nan")
    tree_keys = torch.randn(kv_heads, count, dim, generator=generator).to(device, dtype)
    tree_values = torch.randn(kv_heads, count, dim, generator=generator).to(device, dtype)
    return query, keys, values, tree_keys, tree_values


def as_ar_step(query, keys, values, tree_keys, tree_values, committed, path):
    """The AR step at the position of `path`'s last node: its ancestors' K/V written into the cache
    after the committed keys, the node alone as the step."""
    node = path[-1]
    keys, values = keys.clone(), values.clone()
    for depth, ancestor in enumerate(path[:-1]):
        keys[:, committed + depth] = tree_keys[:, ancestor]
        values[:, committed + depth] = tree_values[:, ancestor]
    position = committed + len(path) - 1
    return (
        query[:, node : node + 1],
        keys,
        values,
        tree_keys[:, node : node + 1],
        tree_values[:, node : node + 1],
        torch.tensor(position, device=keys.device),
        torch.zeros(1, dtype=torch.int32, device=keys.device),
        torch.zeros(1, 1, dtype=torch.int32, device=keys.device),
    )


@interpreter
@pytest.mark.parametrize("committed", [0, 5, 63, 64, 126, 200])
def test_aligned_attention_equals_attention_over_the_committed_keys_and_each_path(committed):
    from tokenswift_trt.kernels.triton_aligned import aligned_attention, aligned_attention_reference

    depths, paths = tree_of(PARENTS)
    tensors = case(4, 2, 64, committed, len(PARENTS), torch.float32, "cpu", 1)
    got = aligned_attention(
        *tensors, torch.tensor(committed), torch.tensor(depths, dtype=torch.int32), padded(paths), 0.125,
        range_keys=128,
    )  # fmt: skip
    expected = aligned_attention_reference(*tensors, committed, depths, paths, 0.125)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


def rows_apart(monkeypatch) -> None:
    """Make the interpreter's product compute each row on its own, as the design assumes a GPU's
    tensor-core product does (the GPU test below checks it there): numpy's matmul gives a row other bits
    at another place in the matrix (OpenBLAS's micro-tiles), which would hide what these tests look for."""
    import numpy as np
    from triton.runtime import interpreter as interpreter_module

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = [np.matmul(a.data[i : i + 1], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return interpreter_module.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter_module.InterpreterBuilder, "create_dot", create_dot)


@interpreter
@pytest.mark.parametrize("committed", [3, 126, 190])  # 126, 190: paths that cross a tile and a range edge
def test_a_nodes_row_is_the_same_bits_as_the_ar_step_at_its_position(committed, monkeypatch):
    from tokenswift_trt.kernels.triton_aligned import aligned_attention

    rows_apart(monkeypatch)

    depths, paths = tree_of(PARENTS)
    tensors = case(4, 2, 64, committed, len(PARENTS), torch.float32, "cpu", 2)
    verify = aligned_attention(
        *tensors, torch.tensor(committed), torch.tensor(depths, dtype=torch.int32), padded(paths), 0.125,
        range_keys=128,
    )  # fmt: skip
    for node, path in enumerate(paths):
        step = aligned_attention(*as_ar_step(*tensors, committed, path), 0.125, range_keys=128)
        assert torch.equal(step[:, 0], verify[:, node]), f"node {node} at depth {depths[node]}"


def test_aligned_attention_refuses_deep_trees_and_unaligned_ranges():
    from tokenswift_trt.kernels.triton_aligned import TILE, aligned_attention

    tensors = case(2, 1, 64, 10, 1, torch.float32, "cpu", 3)
    depth0 = (torch.tensor(10), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 64"):
        aligned_attention(*tensors, *depth0, torch.zeros(1, 1, dtype=torch.int32), 0.125, range_keys=100)
    with pytest.raises(ValueError, match="depth below 64"):
        aligned_attention(*tensors, *depth0, torch.zeros(1, TILE + 1, dtype=torch.int32), 0.125)
    wide = case(2, 1, 48, 10, 1, torch.float32, "cpu", 3)
    with pytest.raises(ValueError, match="head_dim"):
        aligned_attention(*wide, *depth0, torch.zeros(1, 1, dtype=torch.int32), 0.125)


@pytest.mark.skipif(not ON_GPU, reason="the compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("committed", [100_000, 4_031])
def test_aligned_attention_on_cuda_in_bf16_matches_fp64_and_every_node_equals_its_ar_step(committed):
    """The 8B shape in bf16: values against float64 (relative error <= 1e-2), then the assumption the
    design rests on: a row's products do not depend on the other rows of its tile, so each node's row
    equals the AR step's at its position bit for bit."""
    from tokenswift_trt.kernels.triton_aligned import aligned_attention, aligned_attention_reference

    parents = [-1] + [0] * 3 + [1, 1, 2, 3] + list(range(4, 8))  # 12 nodes, depths 0-3
    depths, paths = tree_of(parents)
    tensors = case(32, 8, 128, committed, len(parents), torch.bfloat16, "cuda", 4)
    depth_ids = torch.tensor(depths, dtype=torch.int32, device="cuda")
    verify = aligned_attention(
        *tensors, torch.tensor(committed, device="cuda"), depth_ids, padded(paths).cuda(), 0.088
    )
    torch.cuda.synchronize()
    cpu = [t.float().cpu() for t in tensors]
    expected = aligned_attention_reference(*cpu, committed, depths, paths, 0.088)
    got = verify.double().cpu()
    assert torch.isfinite(got).all()
    assert ((got - expected).norm() / expected.norm()) <= 1e-2
    for node, path in enumerate(paths):
        step = aligned_attention(*as_ar_step(*tensors, committed, path), 0.088)
        assert torch.equal(step[:, 0], verify[:, node]), f"node {node} at depth {depths[node]}"


@pytest.mark.slow  # whole decodes through the interpreter: ~45 s each on 2 cores
@interpreter
@pytest.mark.parametrize("static_steps", [False, True])
def test_a_model_attending_position_aligned_takes_the_kernel_and_keeps_ar_tokens(
    llama_dir, static_steps, monkeypatch
):
    """The model's switch (`LlamaModel.use_batch_invariant(..., attention=True)` sets it on CUDA): every
    AR step and verify goes through `tree_attention_aligned` (the step's K/V found after the committed
    ones, depths and ancestors from the tree mask), a verify's logits match SDPA's, and TokenSwift's
    tokens equal AR's, greedy and seeded sampling, with dynamic and fixed-shape steps."""
    from dataclasses import replace

    from tokenswift_trt.decode.config import GenerationConfig
    from tokenswift_trt.decode.loop import generate
    from tokenswift_trt.kernels import triton_aligned
    from tokenswift_trt.model.kv_cache import KVCache
    from tokenswift_trt.model.sampling import SamplingConfig

    from conftest import quiet_load

    engine = quiet_load(llama_dir[0])
    model = engine.model.torch_model
    calls = []
    original = triton_aligned.tree_attention_aligned

    def counted(*args):
        calls.append(args[4].shape[0])  # the step's row count (its depths)
        return original(*args)

    monkeypatch.setattr(triton_aligned, "tree_attention_aligned", counted)
    # one verify of a 5-node tree after 190 committed tokens (dot tiles, two ranges and the tail): the
    # same logits as through SDPA
    tree = torch.tensor([[s in path for s in range(5)] for path in tree_of(PARENTS)[1]])
    depths = torch.tensor(tree_of(PARENTS)[0])
    prompt = torch.arange(190) % 90 + 3
    logits = []
    for aligned in (False, True):
        model.aligned_attention = aligned
        cache = KVCache(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, 256)
        model.decode(prompt, torch.arange(190), cache)  # a prefill chunk of 190: SDPA either way
        cache.commit()
        out = model.decode(torch.tensor([40, 41, 42, 43, 44]), 190 + depths, cache, tree)
        logits.append(model.logits(out.hidden))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    assert calls == [5, 5]  # the verify, both layers; the long prefill chunk stayed on SDPA
    config = GenerationConfig(
        max_new_tokens=8, tree="1,3,3", seed=5, ignore_eos=True, static_steps=static_steps
    )
    paper = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=16)
    for sampling in (SamplingConfig(temperature=0), paper):
        calls.clear()
        ar, _ = generate(engine, list(range(5, 25)), replace(config, method="ar", sampling=sampling))
        swift, _ = generate(engine, list(range(5, 25)), replace(config, sampling=sampling))
        assert swift == ar
        assert 1 in calls and max(calls) > 1  # AR steps and verifies both went through the kernel
    model.aligned_attention = False


@pytest.mark.slow  # whole decodes through the interpreter
@interpreter
def test_steps_with_nodes_64_levels_deep_or_more_keep_their_kernel(llama_dir, monkeypatch):
    """Position-aligned attention covers depths 0..63: a causal chain of 70 tokens (a tuner's timing
    step, a prefill chunk) stays on the model's other kernel, dynamic and fixed-shape, while a shallow
    tree of the same step size takes the aligned one; fixed-shape steps keep a graph for each."""
    from tokenswift_trt.decode.static_step import StaticForward
    from tokenswift_trt.kernels import triton_aligned
    from tokenswift_trt.model.kv_cache import KVCache

    from conftest import quiet_load

    model = quiet_load(llama_dir[0]).model.torch_model
    calls = []
    original = triton_aligned.tree_attention_aligned

    def counted(*args):
        calls.append(args[4].shape[0])
        return original(*args)

    monkeypatch.setattr(triton_aligned, "tree_attention_aligned", counted)
    model.aligned_attention = True
    try:
        chain = torch.ones(70, 70, dtype=torch.bool).tril()
        flat = torch.eye(70, dtype=torch.bool)
        flat[:, 0] = True  # a root and 69 children: depth 1
        for static in (False, True):
            cache = KVCache(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, 512)
            model.decode(torch.arange(3, 23), torch.arange(20), cache)
            cache.commit()
            forward = StaticForward(model, cache, capture=False) if static else None
            rows = 96 if static else 70  # fixed-shape steps run the bucket's size
            for mask, expected in ((chain, []), (flat, [rows, rows])):
                calls.clear()
                tokens, positions = torch.arange(5, 75), 20 + mask.sum(1) - 1
                if forward is None:
                    model.decode(tokens, positions, cache, mask)
                else:
                    forward.run(tokens, positions, mask)
                cache.pending = 0
                assert calls == expected, (static, expected)
            if forward is not None:
                assert {key[2] for key in forward.buckets} == {False, True}
    finally:
        model.aligned_attention = False
