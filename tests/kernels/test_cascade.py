"""Tree attention as prefix block + tree block + log-sum-exp merge (the GPU cascade's math, on the CPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.kernels.cascade import (
    FLASH_MAX_SPLITS,
    attend_partial,
    cascade_tree_attention,
    flash_cascade_attention,
    flash_splits,
    merge_partials,
    pack_group_rows,
    padded_tree_size,
    split_key_ranges,
    split_offsets,
    unpack_group_rows,
)
from tokenswift_trt.kernels.config import CASCADE_MIN_WORK, KernelConfig, KernelConfigError
from tokenswift_trt.model.engine import choose_attention_kernel, flash_cascade_problem


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


def _cache_with_tree(kv_heads, capacity, prefix, count, dim, dtype, generator, device="cpu"):
    """A whole-capacity cache: committed keys [0, prefix), the tree's own at [prefix, prefix + T), and
    junk past them that the attention must never read."""
    keys = torch.randn(kv_heads, capacity, dim, generator=generator, dtype=torch.float64) * 3
    values = torch.randn(kv_heads, capacity, dim, generator=generator, dtype=torch.float64) * 3
    keys[:, prefix + count :] = 1e4  # junk: would dominate any softmax that read it
    return keys.to(device, dtype), values.to(device, dtype)


@pytest.mark.parametrize(
    "heads,kv_heads,count,prefix,capacity,splits",
    [
        (9, 3, 5, 300, 400, 1),
        (9, 3, 41, 1000, 1100, 4),
        (32, 8, 64, 257, 400, 5),
        (4, 4, 1, 64, 80, 3),  # an AR step
        (8, 2, 7, 3, 20, 6),  # fewer committed keys than ranges: empty ranges must not win the merge
        (8, 2, 7, 0, 16, 2),  # nothing committed: the tree block alone
    ],
)
def test_flash_cascade_equals_one_masked_attention_over_a_whole_capacity_cache(
    heads, kv_heads, count, prefix, capacity, splits
):
    generator = torch.Generator().manual_seed(count + prefix + splits)
    query = torch.randn(heads, count, 16, generator=generator, dtype=torch.float64)
    keys, values = _cache_with_tree(kv_heads, capacity, prefix, count, 16, torch.float64, generator)
    tree = _tree(count, generator)
    expected = kernels.tree_attention_reference(
        query, keys[:, : prefix + count], values[:, : prefix + count], kernels.pack_tree_mask(tree), 0.25
    )
    for fused_tail in (False, True):  # the tail as PyTorch ops, and as the one op (its CPU face here)
        got = flash_cascade_attention(
            query, keys, values, tree, torch.tensor(prefix), 0.25, splits, fused_tail
        )
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_split_offsets_cut_the_committed_keys_into_near_equal_ranges():
    for prefix in (0, 1, 5, 31, 32, 1000, 98_304):
        for splits in (1, 3, 8, 32):
            offsets = split_offsets(torch.tensor(prefix), splits)
            lengths = offsets[1:] - offsets[:-1]
            assert offsets.dtype == torch.int32 and offsets.shape == (splits + 1,)
            assert offsets[0] == 0 and offsets[-1] == prefix and (lengths >= 0).all()
            assert lengths.max() - lengths.min() <= 1  # no range longer than the bound the op is given


def test_flash_splits_fill_the_gpu_without_tiny_ranges():
    # an AR step of a 32/8-head model at 100K: 8 programs per range, so 32 ranges for 132 SMs
    assert flash_splits(4, 8, 102_400, 132) == FLASH_MAX_SPLITS
    # a 64-node verify: 256 rows = 2 row blocks per KV head, 16 programs per range
    assert flash_splits(256, 8, 102_400, 132) == 17
    assert flash_splits(256, 8, 2_000, 132) == 3  # ranges of at least 512 keys
    assert flash_splits(1024, 32, 500, 132) == 1


def test_the_flash_cascade_verifies_as_sdpa_does_in_a_model(llama_dir):
    """The model's own forward with the flash cascade equals SDPA's (dynamic forward on the CPU; the
    fixed-shape forward is tests/decode/test_static_step.py's)."""
    from tokenswift_trt.decode.tree import Trie
    from tokenswift_trt.model.kv_cache import KVCache

    from conftest import quiet_load

    engine = quiet_load(llama_dir[0])
    c = engine.config
    trie = Trie(root_token=7)
    for branch in ([3, 4, 5], [3, 9], [11, 12, 13, 14]):
        trie.add_path(branch, from_tree=True)
    outputs = []
    for kernel in ("sdpa", "flash_cascade"):
        engine.model.use_attention_kernel(kernel)
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 200)
        engine.model(torch.arange(5, 45), torch.arange(40), cache)
        cache.commit()
        tokens, positions = torch.tensor(trie.tokens), torch.tensor(trie.depths) + 40
        outputs.append(engine.model(tokens, positions, cache, tree_mask=trie.mask()).hidden)
    assert (outputs[0] - outputs[1]).abs().max() <= 1e-4


def test_fixed_shape_steps_keep_a_graph_per_attention_route_chosen_from_the_committed_length(
    llama_dir, monkeypatch
):
    """The host loop's fixed-shape verifies (`StaticForward`) choose the route from the committed
    length they know, not the cache's capacity: a generation from a short prompt verifies through the
    fallback first and the cascade later, each its own bucket, with AR's tokens."""
    from tokenswift_trt.decode import static_step
    from tokenswift_trt.decode.config import GenerationConfig
    from tokenswift_trt.decode.loop import generate
    from tokenswift_trt.model.sampling import SamplingConfig

    from conftest import quiet_load

    engine = quiet_load(llama_dir[0], dtype=torch.float64)
    routes: list[tuple[int, bool | None]] = []
    fixed_shape_forward = static_step.fixed_shape_forward

    def recorded(model, cache, tokens, *rest):  # noting each forward's bucket and route
        routes.append((tokens.shape[0], rest[4]))  # (positions, mask, length, columns, route, aligned)
        return fixed_shape_forward(model, cache, tokens, *rest)

    monkeypatch.setattr(static_step, "fixed_shape_forward", recorded)
    assert engine.model.cascade_route(16, 1000) is None  # not on the cascade: no route to choose
    engine.model.use_flash_cascade(16 * (40 + 50 + 16), "sdpa")  # a 16-row verify: ~50 tokens in
    assert engine.model.cascade_route(16, 40) is False and engine.model.cascade_route(16, 90) is True
    prompt = list(range(5, 45))
    base = dict(max_new_tokens=100, sampling=SamplingConfig(temperature=0), ignore_eos=True)
    config = GenerationConfig(**base, tree="2,2,1", ngram_topk=2, draft_source="verify", static_steps=True)
    tokens, _ = generate(engine, prompt, config)
    engine.model.use_attention_kernel("sdpa")
    ar, _ = generate(engine, prompt, GenerationConfig(**base, method="ar"))
    assert tokens == ar
    verify_routes = [route for size, route in routes if size == 16]
    assert verify_routes[0] is False and verify_routes[-1] is True and verify_routes == sorted(verify_routes)


def _tail_case(count: int, prefix: int, splits: int, dtype: torch.dtype, device: str, dim: int = 128):
    """Inputs of `cascade_tail` as the prefix block leaves them on a GPU: outputs [splits, kv, R, D] as a
    permuted view, log-sum-exps as a transposed view, +inf / zeros for empty ranges."""
    generator = torch.Generator().manual_seed(count * 7 + prefix + splits)
    heads, kv_heads, capacity = 32, 8, prefix + count + 40
    rows = heads // kv_heads * count
    query = torch.randn(heads, count, dim, generator=generator).to(device, dtype)
    keys, values = _cache_with_tree(kv_heads, capacity, prefix, count, dim, dtype, generator, device)
    tree = _tree(count, generator).to(device)
    offsets = split_offsets(torch.tensor(prefix), splits).to(device)
    raw = torch.randn(splits * rows, kv_heads, dim, generator=generator)  # the flash op's own layout
    outs = raw.to(device, dtype).view(splits, rows, kv_heads, dim).permute(0, 2, 1, 3)
    lses = (torch.randn(kv_heads, splits * rows, generator=generator) * 3 + 10).to(device)
    lses = lses.view(kv_heads, splits, rows).transpose(0, 1)  # [splits, kv_heads, R], strided
    empty = (offsets[1:] == offsets[:-1]).cpu()
    outs[empty.to(device)] = 0
    lses[empty.to(device)] = float("inf")
    length = torch.tensor(prefix, device=device)
    return query, keys, values, tree, length, outs, lses, offsets


def test_cascade_tail_with_only_empty_ranges_is_the_tree_block_alone():
    """Nothing committed: every range is empty (zeros, log-sum-exp +inf, as FlashAttention leaves
    them) and must not enter the merge; the op (its CPU face here) gives the tree's own attention."""
    from tokenswift_trt.kernels.cascade import cascade_tail

    query, keys, values, tree, length, outs, lses, offsets = _tail_case(5, 0, 3, torch.float32, "cpu", 64)
    got = cascade_tail(query, keys, values, tree, length, outs, lses, offsets, 0.088)
    expected = kernels.tree_attention_reference(
        query, keys[:, :5], values[:, :5], kernels.pack_tree_mask(tree), 0.088
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cascade-tail kernel needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "count,prefix,splits,dim", [(64, 100_000, 17, 128), (128, 5_000, 8, 128), (7, 2, 4, 64), (1, 0, 3, 128)]
)
def test_cascade_tail_kernel_matches_its_reference_and_replays_in_a_graph(dtype, count, prefix, splits, dim):
    """src/cascade_tail.cu against `cascade_tail_reference` (both fp32 inside, one rounding at the end):
    strided prefix outputs and log-sum-exps, empty ranges, a poisoned output; then one captured graph
    replayed at a second committed length (read on the device)."""
    from tokenswift_trt.kernels.cascade import cascade_tail, cascade_tail_reference

    status = kernels.load_cuda_kernels()
    if not status.loaded:
        pytest.skip(status.reason)
    inputs = _tail_case(count, prefix, splits, dtype, "cuda", dim)
    expected = cascade_tail_reference(*inputs, 0.088).float()
    poison = torch.full_like(inputs[0], float("nan"))  # freed: the kernel's output likely reuses it
    del poison
    got = status.module.cascade_tail(*inputs[:4], inputs[4].long(), *inputs[5:], 0.088)
    assert torch.isfinite(got).all() and got.dtype == dtype  # every element written
    assert ((got.float() - expected).norm() / expected.norm()) <= 2e-3
    assert ((cascade_tail(*inputs, 0.088).float() - expected).norm() / expected.norm()) <= 2e-3  # the op
    query, keys, values, tree, length, outs, lses, offsets = inputs
    static_out = torch.full_like(query, float("nan"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cascade_tail(*inputs, 0.088)
        with torch.cuda.graph(graph, stream=stream):
            static_out.copy_(cascade_tail(*inputs, 0.088))
    moved = max(0, prefix // 2 - 3)
    keys[:, moved : moved + count], values[:, moved : moved + count] = (
        keys[:, prefix : prefix + count].clone(),
        values[:, prefix : prefix + count].clone(),
    )
    length.fill_(moved)
    graph.replay()
    torch.cuda.synchronize()
    expected = cascade_tail_reference(*inputs, 0.088).float()
    assert ((static_out.float() - expected).norm() / expected.norm()) <= 2e-3


def test_cuda_attention_choice_by_kernel_settings_with_and_without_the_tree_kernel(llama_dir, monkeypatch):
    """What `choose_attention_kernel` gives a CUDA engine where FlashAttention can run (both probes,
    our own functions, stubbed to a GPU's answers): `auto` = the cascade above the threshold and the
    tree kernel below; without the tree kernel, the cascade for every tree (SDPA over the whole
    capacity is no fallback) with a warning; `kernel` never; the fused tail and the Triton prefix by
    default (each switchable), the kernel setting cascade_min_work overriding the threshold, and a bad
    value refused in one line when the settings are made."""
    from tokenswift_trt.model import engine as engine_module
    from tokenswift_trt.model.engine import KernelFallbackWarning

    from conftest import quiet_load

    model = quiet_load(llama_dir[0]).model
    config = type("C", (), {"head_dim": 64})()
    cuda = torch.device("cuda")
    monkeypatch.setattr(engine_module, "flash_cascade_problem", lambda dtype, head_dim, device: None)
    monkeypatch.setattr(kernels, "shared_memory_problem", lambda status, head_dim, device: None)
    built = kernels.KernelStatus(loaded=True, reason="")
    monkeypatch.setattr(kernels, "load_cuda_kernels", lambda: built)

    def choose(**settings) -> None:
        choose_attention_kernel(model, config, torch.bfloat16, cuda, KernelConfig(**settings))

    choose()
    assert (model.attention_kernel, model.cascade_min_work) == ("flash_cascade", CASCADE_MIN_WORK)
    choose(cascade_min_work=1000)  # a threshold measured on another GPU
    assert model.cascade_min_work == 1000
    with pytest.raises(KernelConfigError, match="cascade_min_work is a positive integer"):
        KernelConfig().updated({"cascade_min_work": "-5"})
    choose()
    # the fused tail and (where Triton is installed, quietly otherwise) the Triton prefix by default
    assert model.cascade_fallback == "tree_attention" and model.cascade_fused_tail
    has_triton = importlib.util.find_spec("triton") is not None
    assert model.cascade_prefix == ("triton" if has_triton else "flash")
    choose(cascade_tail="torch")
    assert not model.cascade_fused_tail and "fused tail" not in model.attention_summary()
    choose(cascade_tail="kernel")
    assert model.cascade_fused_tail and "fused tail" in model.attention_summary()
    choose(cascade_prefix="flash")
    assert model.cascade_prefix == "flash"
    if not has_triton:  # asked for by name: a warning where it cannot run
        with pytest.warns(KernelFallbackWarning, match="needs Triton"):
            choose(cascade_prefix="triton")
        assert model.cascade_prefix == "flash"
    else:
        choose(cascade_prefix="triton")
        assert model.cascade_prefix == "triton" and "triton prefix" in model.attention_summary()
    if has_triton:  # a launch the sweep measured best
        choose(cascade_prefix="triton:128,128,8,4")
        assert model.cascade_prefix == "triton:128,128,8,4"
    if has_triton and torch.cuda.is_available():  # the accelerator: Hopper and later
        if torch.cuda.get_device_capability()[0] >= 9:
            choose(cascade_prefix="triton:128,64,8,3,tma")
            assert model.cascade_prefix == "triton:128,64,8,3,tma"
        else:
            with pytest.raises(ValueError, match="needs a Hopper or later GPU"):
                choose(cascade_prefix="triton:128,64,8,3,tma")
    for bad in ("cutlass", "triton:100,64,8,3", "triton:128,64", "triton:128,64,8,3,wgmma"):
        with pytest.raises(KernelConfigError, match="kernel setting cascade_prefix: ") as caught:
            KernelConfig(cascade_prefix=bad)
        assert "\n" not in str(caught.value)
    choose(cuda_attention="kernel")
    assert model.attention_kernel == "tree_attention"
    monkeypatch.setattr(kernels, "load_cuda_kernels", lambda: kernels.KernelStatus(False, "no nvcc"))
    with pytest.warns(KernelFallbackWarning, match="no nvcc"):
        choose(cuda_attention="auto")
    assert (model.attention_kernel, model.cascade_min_work, model.cascade_fallback) == (
        "flash_cascade",
        0,
        "sdpa",
    )
    with pytest.raises(KernelConfigError, match="cascade_tail is one of kernel, torch"):
        KernelConfig(cascade_tail="fast")


def test_the_tree_kernel_takes_its_row_tiles_from_the_settings(llama_dir, monkeypatch):
    """tree_row_tiles reaches the compiled module once, at load (C++ reads no environment)."""
    from tokenswift_trt.model import engine as engine_module

    from conftest import quiet_load

    model = quiet_load(llama_dir[0]).model
    config = type("C", (), {"head_dim": 64})()
    calls = []
    module = type("Module", (), {"set_tree_row_tiles": staticmethod(calls.append)})()
    monkeypatch.setattr(engine_module, "flash_cascade_problem", lambda dtype, head_dim, device: None)
    monkeypatch.setattr(kernels, "shared_memory_problem", lambda status, head_dim, device: None)
    monkeypatch.setattr(kernels, "load_cuda_kernels", lambda: kernels.KernelStatus(True, "", module))
    for tiles in (2, 0):
        settings = KernelConfig(tree_row_tiles=tiles, cuda_attention="kernel")
        choose_attention_kernel(model, config, torch.bfloat16, torch.device("cuda"), settings)
    assert calls == [2, 0] and model.attention_kernel == "tree_attention"
    with pytest.raises(KernelConfigError, match="tree_row_tiles is one of 0, 1, 2"):
        KernelConfig().updated({"tree_row_tiles": "3"})


def test_the_flash_cascade_is_refused_where_it_cannot_run():
    assert "float16/bfloat16" in flash_cascade_problem(torch.float32, 128, torch.device("cpu"))
    assert "head_dim" in flash_cascade_problem(torch.bfloat16, 100, torch.device("cpu"))
    with pytest.raises(KernelConfigError, match="cuda_attention is one of auto, kernel, flash_cascade"):
        KernelConfig().updated({"cuda_attention": "fast"})


def test_the_cascade_runs_only_where_rows_times_keys_reach_its_threshold_and_the_fallback_elsewhere(
    llama_dir,
):
    """`auto` (the CUDA default): the cascade's fixed cost per layer pays only for wide trees over long
    contexts; narrow verifies and AR steps take the fallback kernel, dynamic and fixed-shape alike."""
    from tokenswift_trt.model.decoder import StaticAttention
    from tokenswift_trt.model.kv_cache import KVCache

    from conftest import quiet_load

    engine = quiet_load(llama_dir[0])
    model, c = engine.model, engine.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 200)
    engine.model(torch.arange(100) % 40 + 5, torch.arange(100), cache)
    cache.commit()  # 100 committed keys
    model.use_flash_cascade(16 * 116, "sdpa")
    cpu = torch.device("cpu")
    assert model._attention_mask(16, cache, None, None, cpu).kernel == "flash_cascade"  # 16 x 116 keys
    assert model._attention_mask(15, cache, None, None, cpu).kernel == "sdpa"  # 15 x 115 < 16 x 116
    assert model._attention_mask(1, cache, None, None, cpu).kernel == "sdpa"
    full = torch.ones(8, 128, dtype=torch.bool)  # fixed shape: the capacity is the mask's width
    static = StaticAttention(
        full_mask=full, tree_mask=torch.ones(8, 8, dtype=torch.bool).tril(), prefix_length=torch.tensor(100)
    )
    assert model._attention_mask(8, cache, None, static, cpu).kernel == "sdpa"  # 8 x 128 < 1,856
    model.use_flash_cascade(8 * 128, "sdpa")
    assert model._attention_mask(8, cache, None, static, cpu).kernel == "flash_cascade"
    model.use_flash_cascade(0, "sdpa")  # `flash_cascade` by name: every tree
    assert model._attention_mask(1, cache, None, None, cpu).kernel == "flash_cascade"
    with pytest.raises(ValueError, match="fallback"):
        model.use_flash_cascade(0, "flash_cascade")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's CUDA op needs a CUDA GPU")
@pytest.mark.parametrize(
    "count,prefix,splits", [(64, 100_000, 17), (1, 100_000, 32), (41, 4_000, 3), (7, 2, 4)]
)
def test_flash_cascade_on_cuda_matches_the_reference_in_bfloat16_and_under_graph_capture(
    count, prefix, splits
):
    """Per METHOD: fresh random inputs, a poisoned output, bf16 relative error <= 1e-2 against the fp32
    reference; then one captured graph replayed at two committed lengths (the length lives on the device)."""
    if flash_cascade_problem(torch.bfloat16, 128, torch.device("cuda")) is not None:
        pytest.skip(flash_cascade_problem(torch.bfloat16, 128, torch.device("cuda")))
    generator = torch.Generator().manual_seed(count + prefix)
    heads, kv_heads, capacity = 32, 8, prefix + 256
    query = torch.randn(heads, count, 128, generator=generator).to("cuda", torch.bfloat16)
    keys, values = _cache_with_tree(kv_heads, capacity, prefix, count, 128, torch.bfloat16, generator, "cuda")
    tree = _tree(count, generator).cuda()
    length = torch.tensor(prefix, device="cuda")

    def reference(committed: int) -> torch.Tensor:
        end = committed + count
        tree_keys = (keys[:, end - count : end], values[:, end - count : end])
        k = torch.cat((keys[:, :committed], tree_keys[0]), 1)
        v = torch.cat((values[:, :committed], tree_keys[1]), 1)
        return kernels.tree_attention_reference(
            query.float(), k.float(), v.float(), kernels.pack_tree_mask(tree), 0.088
        )

    out = flash_cascade_attention(query, keys, values, tree, length, 0.088, splits)
    expected = reference(prefix)
    assert torch.isfinite(out).all()
    assert ((out.float() - expected).norm() / expected.norm()) <= 1e-2
    static_out = torch.full_like(out, float("nan"))  # poisoned: every element must be written
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flash_cascade_attention(
            query, keys, values, tree, length, 0.088, splits
        )  # warm up on the side stream
        with torch.cuda.graph(graph, stream=stream):
            static_out.copy_(flash_cascade_attention(query, keys, values, tree, length, 0.088, splits))
    for committed in (prefix, max(0, prefix // 2 - 3)):
        length.fill_(committed)
        keys[:, committed : committed + count], values[:, committed : committed + count] = (
            keys[:, prefix : prefix + count].clone(),
            values[:, prefix : prefix + count].clone(),
        )
        graph.replay()
        torch.cuda.synchronize()
        expected = reference(committed)
        assert ((static_out.float() - expected).norm() / expected.norm()) <= 1e-2


def test_flash_cascade_in_bfloat16_stays_within_bf16_error_of_the_fp32_reference():
    """The dtypes of a GPU run (bf16 rows and cache, fp32 log-sum-exps and merge), on the CPU flash op."""
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, count, prefix, capacity = 8, 2, 24, 900, 1000
    query = torch.randn(heads, count, 64, generator=generator).bfloat16()
    keys, values = _cache_with_tree(kv_heads, capacity, prefix, count, 64, torch.bfloat16, generator)
    tree = _tree(count, generator)
    got = flash_cascade_attention(query, keys, values, tree, torch.tensor(prefix), 0.125, 4)
    end = prefix + count
    expected = kernels.tree_attention_reference(
        query.float(), keys[:, :end].float(), values[:, :end].float(), kernels.pack_tree_mask(tree), 0.125
    )
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert (got.float() - expected).norm() / expected.norm() <= 1e-2


def test_prefix_backends_and_launches_parse_and_bad_ones_say_what_is_allowed():
    from tokenswift_trt.kernels.prefix_config import PrefixConfig, default_prefix_config, parse_prefix_backend

    assert parse_prefix_backend("flash") == ("flash", None)
    assert parse_prefix_backend("triton") == ("triton", None)
    assert parse_prefix_backend("triton:64,128,4,2") == ("triton", PrefixConfig(64, 128, 4, 2))
    assert PrefixConfig(64, 128, 4, 2).text() == "64,128,4,2"
    for variant in ("split", "tma"):  # the other kernels: a fifth field, which the text gives back
        launch = PrefixConfig(128, 64, 8, 3, variant)
        assert parse_prefix_backend(f"triton:128,64,8,3,{variant}") == ("triton", launch)
        assert parse_prefix_backend(f"triton:{launch.text()}") == ("triton", launch)
    assert parse_prefix_backend("triton:128,64,8,3,loads") == ("triton", PrefixConfig(128, 64, 8, 3))
    assert default_prefix_config(256) == PrefixConfig(128, 64, 8, 3)
    assert default_prefix_config(28) == PrefixConfig(64, 64, 4, 3)
    # Hopper and later: the split loop on 64 x 64 tiles (best on an H100); older GPUs keep the masked loads
    assert default_prefix_config(256, (9, 0)) == PrefixConfig(64, 64, 4, 3, "split")
    assert default_prefix_config(28, (10, 0)) == PrefixConfig(64, 64, 4, 3, "split")
    assert default_prefix_config(256, (8, 0)) == PrefixConfig(128, 64, 8, 3)
    for bad, message in (
        ("flash:64,64,4,3", "is `flash`, `triton` or"),
        ("triton:64,64,4", "is `flash`, `triton` or"),
        ("triton:48,64,4,3", "BLOCK_M and BLOCK_N from"),
        ("triton:64,64,3,3", "WARPS from"),
        ("triton:256,64,8,3", "BLOCK_M and BLOCK_N from"),
        ("triton:64,64,16,3", "WARPS from"),
        ("triton:64,64,4,9", "STAGES 1-6"),
        ("triton:64,64,4,3,wgmma", "VARIANT is one of loads, split, tma"),
        ("triton:64,64,4,3,tma,x", "is `flash`, `triton` or"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_prefix_backend(bad)
