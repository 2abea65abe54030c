"""Prepacked linear layers (our tiled kernel for float32, oneDNN otherwise): same function as
nn.Linear, used only for CPU inference, never stale; the tiled kernel is batch-invariant."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.linear import (
    TILED_MAX_ROWS,
    FusedLinears,
    Linear,
    pack_linears,
    packing_available,
    tiled_kernels,
)

from conftest import quiet_load
from helpers import huge_page_kib, huge_pages_granted

pytestmark = pytest.mark.skipif(
    not packing_available(), reason="this torch build has no oneDNN linear prepacking"
)


def _layer(dtype: torch.dtype, bias: bool) -> Linear:
    torch.manual_seed(0)
    return Linear(64, 48, bias=bias).to(dtype)


PLAIN_PRODUCTS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul")


def _uses_plain_product(run) -> bool:
    """Whether `run()` went through PyTorch's own matrix product (F.linear) rather than a packed copy."""
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        run()
    return any(event.key in PLAIN_PRODUCTS for event in trace.key_averages())


def _uses_packed_op(layer: Linear, x: torch.Tensor) -> bool:
    with torch.inference_mode():
        return not _uses_plain_product(lambda: layer(x))


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 64), (4, 64), (40, 64), (4, 3, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_forward_equals_nn_linear(dtype, tolerance, shape, bias):
    layer = _layer(dtype, bias)
    x = torch.randn(shape).to(dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    packed = layer.pack()
    # float32 packs wherever oneDNN is built in; bfloat16 needs AVX-512 (or AVX-NE-CONVERT) and
    # otherwise falls back to F.linear, with the same results
    assert packed == layer.packed and (packed or dtype == torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == expected.shape and out.dtype == dtype
    assert torch.allclose(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    rows = x.numel() // 64
    assert _uses_packed_op(layer, x) == (packed and layer._packed.takes(rows))


def test_a_changed_weight_is_never_served_from_the_stale_pack():
    layer = _layer(torch.float32, bias=True)
    layer.pack()
    x = torch.randn(4, 64)
    with torch.no_grad():
        layer.weight.add_(1.0)  # in place, as an optimiser step does
    assert not layer.packed
    with torch.inference_mode():
        out = layer(x)
    assert torch.allclose(out, F.linear(x, layer.weight, layer.bias), atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.zeros_like(layer.weight))  # a new Parameter, as loading does
    with torch.inference_mode():
        assert torch.allclose(layer(x), layer.bias.expand(4, -1))
    assert layer.pack() and layer.packed


def test_training_takes_the_autograd_path():
    layer = _layer(torch.float32, bias=True)
    layer.pack()
    x = torch.randn(4, 64, requires_grad=True)
    assert _uses_plain_product(lambda: layer(x).square().sum().backward())
    reference = _layer(torch.float32, bias=True)
    x2 = x.detach().clone().requires_grad_(True)
    reference(x2).square().sum().backward()
    assert torch.allclose(layer.weight.grad, reference.weight.grad) and torch.allclose(x.grad, x2.grad)


def test_only_cpu_float_weights_are_packed():
    assert not Linear(8, 8).to(torch.float64).pack()
    with torch.device("meta"):
        assert not Linear(8, 8).pack()


def test_cpu_engines_pack_every_linear(llama_dir):
    engine = quiet_load(llama_dir[0])  # float32 on the CPU
    layers = [
        m for m in list(engine.model.modules()) + list(engine.draft_layers.modules()) if isinstance(m, Linear)
    ]
    fused = {
        id(part)
        for module in engine.model.modules()
        if getattr(module, "fused", None) is not None
        for part in module.fused.parts
    }
    assert len(fused) == 5 * engine.config.num_layers  # Q, K, V, gate, up of every layer
    assert layers and all(layer.packed or id(layer) in fused for layer in layers)
    assert pack_linears(engine.model) == len([m for m in engine.model.modules() if isinstance(m, Linear)])
    assert not any(
        layer.packed
        for layer in quiet_load(llama_dir[0], dtype=torch.float64).model.modules()
        if isinstance(layer, Linear)
    )


def test_engines_loaded_under_inference_mode_are_packed(llama_dir):
    with torch.inference_mode():
        engine = quiet_load(llama_dir[0])
        x = torch.randn(3, engine.config.hidden_size)
        assert engine.model.lm_head.packed
        assert torch.allclose(engine.model.lm_head(x), F.linear(x, engine.model.lm_head.weight), atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_a_fused_product_equals_its_packed_parts_bit_for_bit(bias, rows):
    torch.manual_seed(1)
    parts = [Linear(64, size, bias=bias) for size in (64, 16, 16)]
    fused = FusedLinears.pack(parts)
    assert fused is not None and not any(part.packed for part in parts)  # the fused copy replaces theirs
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        assert fused.usable(x)
        outputs = fused(x)
        for part in parts:
            part.pack()
        for out, part in zip(outputs, parts):
            assert torch.equal(out, part(x))
    assert not fused.usable(x)  # outside inference mode (training, export) the parts run


def test_engine_logits_are_the_same_with_and_without_fusion_and_never_stale(llama_dir):
    engine = quiet_load(llama_dir[0])
    model, config = engine.model, engine.config
    model.cpu_decoder = None  # the layers' own PyTorch code, whose products this test is about
    tokens = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))

    def logits() -> torch.Tensor:
        cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 16)
        return model.logits(model(tokens, torch.arange(12), cache).hidden)

    fused = logits()
    attention = model.model.layers[0].self_attn
    with torch.inference_mode():
        assert attention.fused.usable(torch.randn(1, config.hidden_size))
    saved = [(layer.self_attn.fused, layer.mlp.fused) for layer in model.model.layers]
    for layer in model.model.layers:
        layer.self_attn.fused = layer.mlp.fused = None
    pack_linears(model)
    assert torch.equal(fused, logits())
    for layer, (attention_fused, mlp_fused) in zip(model.model.layers, saved):
        layer.self_attn.fused, layer.mlp.fused = attention_fused, mlp_fused
    with torch.no_grad():
        attention.k_proj.weight.mul_(0.5)  # in place: the fused copy is now stale
    with torch.inference_mode():
        assert not attention.fused.usable(torch.randn(1, config.hidden_size))
    assert not torch.equal(fused, logits())


tiled = pytest.mark.skipif(
    tiled_kernels() is None, reason="the tiled kernel needs an x86 CPU with AVX2 and a C++ compiler"
)


@tiled
@pytest.mark.parametrize("bias", [False, True])
def test_the_tiled_kernel_is_batch_invariant(bias):
    """Every row's outputs are the same bits whatever else is in the call: one row alone (an AR
    step) or the first rows of a tree, one row tile or several (4 rows per tile on AVX2, 8 on
    AVX-512). Shapes off the kernel's blocks: 100 outputs (blocks of 24 or 48, the last padded), 300
    inputs (passes of 256 or 128 k, the last partial). More rows than the
    kernel takes (a prompt) run PyTorch's product, with the same values within rounding."""
    torch.manual_seed(2)
    layer = Linear(300, 100, bias=bias)
    assert layer.pack() and layer._packed.kind == "tiled"
    x = torch.randn(TILED_MAX_ROWS + 21, 300)
    with torch.inference_mode():
        together = layer(x[:TILED_MAX_ROWS])
        assert torch.allclose(together, F.linear(x[:TILED_MAX_ROWS], layer.weight, layer.bias), atol=1e-5)
        for rows in (1, 2, 3, 5, 8, 9, 13):
            assert torch.equal(layer(x[:rows]), together[:rows]), rows
        assert all(torch.equal(layer(x[i : i + 1]), together[i : i + 1]) for i in range(TILED_MAX_ROWS))
        assert not _uses_plain_product(lambda: layer(x[:TILED_MAX_ROWS]))
        assert _uses_plain_product(lambda: layer(x))  # a prompt's rows
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


@tiled
def test_the_kernel_setting_falls_back_to_onednn():
    layer = _layer(torch.float32, bias=True)
    assert layer.pack(kernels=KernelConfig(cpu_kernel="off")) and layer._packed.kind == "onednn"
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


@tiled
@pytest.mark.parametrize("bias", [False, True])
def test_a_half_precision_pack_is_the_float32_product_of_the_rounded_weight(bias):
    """`pack(half=True)` stores float16 (half the bytes) and computes exactly what the float32
    kernel computes for the weight rounded to float16, row-invariant like it; the parameter itself
    stays float32. Shapes off the kernel's blocks as above."""
    torch.manual_seed(3)
    layer = Linear(300, 100, bias=bias)
    rounded = Linear(300, 100, bias=bias)
    with torch.no_grad():
        rounded.weight.copy_(layer.weight.half().float())
        if bias:
            rounded.bias.copy_(layer.bias)
    assert layer.pack(half=True) and rounded.pack()
    assert layer._packed.data.dtype == torch.float16 and rounded._packed.data.dtype == torch.float32
    assert layer._packed.data.numel() == rounded._packed.data.numel()
    assert layer.weight.dtype == torch.float32
    x = torch.randn(TILED_MAX_ROWS, 300)
    with torch.inference_mode():
        together = layer(x)
        assert torch.equal(together, rounded(x))
        assert not torch.equal(together, F.linear(x, layer.weight, layer.bias))  # it is rounded
        assert torch.allclose(together, F.linear(x, layer.weight, layer.bias), atol=2e-2)
        for rows in (1, 3, 5):
            assert torch.equal(layer(x[:rows]), together[:rows]), rows


@tiled
def test_engines_pack_their_draft_layers_in_half_precision_and_the_model_in_float32(llama_dir):
    engine = quiet_load(llama_dir[0])
    drafts = [m for m in engine.draft_layers.modules() if isinstance(m, Linear)]
    model = [m for m in engine.model.modules() if isinstance(m, Linear) and m._packed is not None]
    assert drafts and all(m._packed.data.dtype == torch.float16 for m in drafts)
    assert model and all(m._packed.data.dtype == torch.float32 for m in model)


@pytest.mark.skipif(tiled_kernels() is None, reason="the tiled kernel needs x86 AVX2 and a C++ compiler")
@pytest.mark.parametrize("half", [False, True])
def test_large_packed_weights_start_on_a_huge_page_and_ask_for_them(half):
    kernels = tiled_kernels()
    pack = kernels.pack_linear_half if half else kernels.pack_linear
    weight = torch.randn(4096, 576)  # 9.4 MB packed in float32, 4.7 MB in float16
    packed = pack(weight)
    assert packed.data_ptr() % (2 << 20) == 0
    x = torch.randn(3, 576)
    stored = weight.half().float() if half else weight
    assert torch.allclose(kernels.linear(x, packed, x.new_empty(0), 4096), x @ stored.T, atol=1e-3)
    if huge_pages_granted():  # the kernel honours MADV_HUGEPAGE here: the weight is on 2 MB pages
        assert huge_page_kib(packed.data_ptr()) >= 2048
    plain = pack(weight, False)  # the kernel setting huge_pages=off
    assert torch.equal(plain, packed)
