"""Fused elementwise ops: residual add + RMSNorm (`kernels.add_rms_norm`, src/rms_norm.cu) and the q/k
rotary embedding (`kernels.rotary_qk`, src/rotary.cu), one CUDA kernel each: the same functions as the
model's own ops, and a model running its layers through them gives the same numbers and tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.kernels.ops import apply_rotary
from tokenswift_trt.model.decoder import RMSNorm
from tokenswift_trt.model.engine import choose_fused_elementwise
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig

from conftest import quiet_load


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_the_models_add_then_norm(dtype, with_delta):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=generator).to(dtype)
    delta = torch.randn(5, 96, generator=generator).to(dtype) if with_delta else None
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=generator) + 0.5)
        total, normed = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        expected = x + delta if with_delta else x
        assert torch.equal(total, expected) and total.data_ptr() != x.data_ptr()
        assert torch.equal(normed, norm(expected))


def test_rotary_qk_is_apply_rotary_on_strided_projections():
    generator = torch.Generator().manual_seed(4)
    projected = torch.randn(6, 6 * 16, generator=generator).bfloat16()  # [T, (4 heads + 2 kv heads) · D]
    q = projected[:, :64].view(6, 4, 16).transpose(0, 1)  # [heads, T, D], strided as the model's are
    k = projected[:, 64:].view(6, 2, 16).transpose(0, 1)
    cos = torch.randn(6, 16, generator=generator).bfloat16()
    sin = torch.randn(6, 16, generator=generator).bfloat16()
    rotated_q, rotated_k = kernels.rotary_qk(q, k, cos, sin)
    assert rotated_q.is_contiguous() and rotated_k.is_contiguous()
    assert torch.equal(rotated_q, apply_rotary(q, cos, sin))
    assert torch.equal(rotated_k, apply_rotary(k, cos, sin))


def test_a_model_with_fused_elementwise_ops_computes_what_the_plain_layers_do(llama_dir):
    """float64: the packed Q/K/V and gate/up products order their sums as the product library likes,
    so the two sides agree to rounding; the elementwise ops themselves are the same functions."""
    engine = quiet_load(llama_dir[0], dtype=torch.float64)  # its own engine: this test repacks weights
    engine.model.cpu_decoder = None  # the Python layers on both sides (the compiled CPU stack has its own)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # real norms are not all ones: a norm taken from the wrong layer must show
        for name, param in engine.model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    c = engine.config
    outputs = []
    for fused in (False, True):
        engine.model.use_fused_elementwise(fused)
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 100, dtype=torch.float64)
        engine.model(torch.arange(5, 45), torch.arange(40), cache)
        cache.commit()
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        outputs.append(engine.model(torch.tensor([7, 3, 9]), torch.tensor([40, 41, 41]), cache, tree, True))
    torch.testing.assert_close(outputs[1].hidden, outputs[0].hidden, rtol=1e-12, atol=1e-12)
    for fused_queries, plain_queries in zip(outputs[1].queries, outputs[0].queries):
        torch.testing.assert_close(fused_queries, plain_queries, rtol=1e-12, atol=1e-12)
    attention, mlp = engine.model.model.layers[0].self_attn, engine.model.model.layers[0].mlp
    assert attention.qkv is not None and mlp.gate_up is not None  # the packed products ran
    assert attention.k_proj.weight.data_ptr() == attention.qkv.weight[attention.qkv.sizes[0]].data_ptr()
    config = GenerationConfig(
        max_new_tokens=40, tree="1,3,3", sampling=SamplingConfig(min_p=0.1), seed=2, ignore_eos=True
    )
    engine.model.use_fused_elementwise(False)
    plain, _ = generate(engine, list(range(5, 40)), config)
    engine.model.use_fused_elementwise(True)
    fused, _ = generate(engine, list(range(5, 40)), config)
    ar, _ = generate(engine, list(range(5, 40)), replace(config, method="ar"))
    assert fused == plain == ar


def test_fused_elementwise_ops_are_on_for_cuda_half_engines_by_default_and_off_elsewhere_or_when_asked(
    monkeypatch,
):
    turned_on: list[bool] = []
    model = type("M", (), {"use_fused_elementwise": lambda self, on: turned_on.append(on)})()
    choose_fused_elementwise(model, torch.float32, torch.device("cpu"))
    choose_fused_elementwise(model, torch.bfloat16, torch.device("cpu"))
    choose_fused_elementwise(model, torch.float32, torch.device("cuda"))
    off = KernelConfig(fused_elementwise=False)
    choose_fused_elementwise(model, torch.bfloat16, torch.device("cuda"), off)  # switched off
    assert turned_on == []
    loaded = kernels.KernelStatus(loaded=True, reason="")
    monkeypatch.setattr(kernels, "load_cuda_kernels", lambda: loaded)  # as on a GPU where they built
    choose_fused_elementwise(model, torch.bfloat16, torch.device("cuda"))  # on by default
    assert turned_on == [True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (64, 4096), (256, 576), (3, 1000)])
def test_the_cuda_kernel_matches_the_reference(dtype, rows, hidden):
    status = kernels.load_cuda_kernels()
    if not status.loaded:
        pytest.skip(status.reason)
    generator = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=generator) * 4).to("cuda", dtype)
    delta = torch.randn(rows, hidden, generator=generator).to("cuda", dtype)
    weight = (torch.rand(hidden, generator=generator) + 0.5).to("cuda", dtype)
    for add in (delta, None):
        total, normed = kernels.add_rms_norm(x, add, weight, 1e-5)
        ref_total, ref_normed = kernels.add_rms_norm_reference(x, add, weight, 1e-5)
        assert torch.equal(total, ref_total)  # the add rounds as PyTorch's does
        assert torch.isfinite(normed).all()
        # only the fp32 sum of squares is ordered differently: the normalised value can differ in its
        # last bit, which the weight's product (weights in [0.5, 1.5]) can make two units in the last place
        ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        bound = 2 * ulp * ref_normed.float().abs() + 1e-6
        assert ((normed.float() - ref_normed.float()).abs() <= bound).all()
    # a row's outputs are the same bits alone and among 64 (batch invariance)
    many = kernels.add_rms_norm(x, delta, weight, 1e-5)[1]
    one = kernels.add_rms_norm(x[:1].clone(), delta[:1].clone(), weight, 1e-5)[1]
    assert torch.equal(many[:1], one)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,tokens,dim", [(32, 8, 1, 128), (32, 8, 64, 128), (9, 3, 200, 64)])
def test_the_cuda_rotary_kernel_gives_apply_rotarys_bits(dtype, heads, kv_heads, tokens, dim):
    status = kernels.load_cuda_kernels()
    if not status.loaded:
        pytest.skip(status.reason)
    generator = torch.Generator().manual_seed(heads + tokens)
    projected = torch.randn(tokens, (heads + kv_heads) * dim, generator=generator).to("cuda", dtype)
    q = projected[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1)
    k = projected[:, heads * dim :].view(tokens, kv_heads, dim).transpose(0, 1)
    angles = torch.rand(tokens, dim, generator=generator) * 6.3
    cos, sin = angles.cos().to("cuda", dtype), angles.sin().to("cuda", dtype)
    rotated_q, rotated_k = kernels.rotary_qk(q, k, cos, sin)
    assert torch.equal(rotated_q, apply_rotary(q, cos, sin))  # no reduction: the same bits
    assert torch.equal(rotated_k, apply_rotary(k, cos, sin))


def test_silu_mul_is_silu_of_gate_times_up():
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(1)).bfloat16()
    gate, up = gate_up[:, :40], gate_up[:, 40:]
    assert torch.equal(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inner", [(1, 14336), (64, 14336), (7, 1536)])
def test_the_cuda_silu_mul_kernel_gives_pytorchs_bits(dtype, rows, inner):
    status = kernels.load_cuda_kernels()
    if not status.loaded:
        pytest.skip(status.reason)
    gate_up = (torch.randn(rows, 2 * inner, generator=torch.Generator().manual_seed(rows)) * 3).to(
        "cuda", dtype
    )
    expected = kernels.silu_mul_reference(gate_up)
    got = kernels.silu_mul(gate_up)
    mismatched = (got != expected).float().mean().item()
    assert mismatched == 0.0, f"{mismatched:.2%} of the outputs differ from PyTorch's silu * up"


def test_the_partial_caches_selection_gets_a_contiguous_query_with_fused_ops(llama_dir, monkeypatch):
    """With the fused rotary, a verify's queries are [heads, T, D] in memory, so the latest one picked
    from a multi-token pass is a strided view; the CUDA selection kernel takes contiguous queries only,
    so the cache hands it a contiguous copy (checked here on what the op receives)."""
    from tokenswift_trt.model import kv_cache

    engine = quiet_load(llama_dir[0], dtype=torch.float64)
    engine.model.cpu_decoder = None
    engine.model.use_fused_elementwise(True)
    seen: list[bool] = []
    select = kv_cache.kv_importance_select

    def checked(keys, query, keep, sinks):
        seen.append(query.is_contiguous())
        return select(keys, query, keep, sinks)

    monkeypatch.setattr(kv_cache, "kv_importance_select", checked)
    config = GenerationConfig(
        max_new_tokens=48, tree="1,3,3", draft_source="partial", kv_budget=24, seed=1, ignore_eos=True
    )
    fused, _ = generate(engine, list(range(5, 45)), config)
    assert seen and all(seen)
    ar, _ = generate(engine, list(range(5, 45)), replace(config, method="ar"))
    assert fused == ar
