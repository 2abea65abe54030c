"""Batch-invariant products (kernels/triton_linear.py): through Triton's interpreter on the CPU where
Triton is installed, compiled on a GPU where there is one; and the model's switch everywhere."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tokenswift_trt.model.decoder import RMSNorm
from tokenswift_trt.model.linear import Linear

from conftest import quiet_load

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:  # Triton reads this when it is first imported
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU: its interpreter runs the programs on CPU tensors
HAS_TRITON = True
try:
    import triton  # noqa: F401
except ImportError:
    HAS_TRITON = False
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="Triton comes with CUDA builds of PyTorch; none here"
)
interpreter = pytest.mark.skipif(
    ON_GPU or os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (no GPU)"
)


@needs_triton
@interpreter
@pytest.mark.parametrize(
    "rows,depth,columns,bias", [(1, 200, 70, False), (130, 2100, 64, True), (5, 64, 1, True)]
)
def test_batch_invariant_product_equals_linear_and_a_row_alone_in_the_interpreter(rows, depth, columns, bias):
    from tokenswift_trt.kernels.triton_linear import linear, splits_for

    generator = torch.Generator().manual_seed(rows + depth)
    x = torch.randn(rows, depth, generator=generator)
    weight = torch.randn(columns, depth, generator=generator)
    b = torch.randn(columns, generator=generator) if bias else None
    out = linear(x, weight, b)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=1e-4, atol=1e-4)
    for row in {0, rows // 2, rows - 1}:  # the same bits alone as among the others
        assert torch.equal(linear(x[row : row + 1], weight, b)[0], out[row])
    assert splits_for(4096) == 4 and splits_for(14336) == 14 and splits_for(576) == 1  # from K alone


def test_the_model_switch_reaches_every_base_product_and_norm_but_not_the_draft_layers(llama_dir):
    engine = quiet_load(llama_dir[0])
    model = engine.model
    model.use_fused_elementwise(True)  # packed products exist before the switch ...
    model.use_batch_invariant(True)
    linears = [m for m in [*model.model.modules(), model.lm_head] if isinstance(m, Linear)]
    norms = [m for m in model.model.modules() if isinstance(m, RMSNorm)]
    assert linears and all(m.batch_invariant for m in linears) and all(n.row_wise for n in norms)
    assert all(
        layer.self_attn.qkv.batch_invariant and layer.mlp.gate_up.batch_invariant
        for layer in model.model.layers
    )
    assert not any(getattr(m, "batch_invariant", False) for m in engine.draft_layers.modules())
    model.use_fused_elementwise(False)
    model.use_fused_elementwise(True)  # ... and packed products made after it inherit it
    assert all(layer.self_attn.qkv.batch_invariant for layer in model.model.layers)
    assert model.aligned_attention  # and its steps' attention, position-aligned
    model.use_batch_invariant(True, attention=False)  # the kernel setting batch_invariant=products
    assert not model.aligned_attention and all(m.batch_invariant for m in linears)
    model.use_batch_invariant(False)
    assert not any(m.batch_invariant for m in linears) and not any(n.row_wise for n in norms)
    assert not model.aligned_attention
    model.use_fused_elementwise(False)


def test_the_batch_invariant_kernel_setting(llama_dir):
    """batch_invariant: `off` (default) and a CPU change nothing; a bad value is refused in one line."""
    from tokenswift_trt.kernels.config import KernelConfig, KernelConfigError
    from tokenswift_trt.model.engine import choose_batch_invariant

    model = quiet_load(llama_dir[0]).model
    for mode in ("off", "on", "products"):
        choose_batch_invariant(model, torch.float32, torch.device("cpu"), KernelConfig(batch_invariant=mode))
        assert not model.batch_invariant and not model.aligned_attention
    with pytest.raises(KernelConfigError, match="batch_invariant is one of off, on, products, got 'yes'"):
        KernelConfig().updated({"batch_invariant": "yes"})


@pytest.mark.skipif(not ON_GPU or not HAS_TRITON, reason="the compiled programs need a CUDA GPU and Triton")
@pytest.mark.parametrize("depth,columns", [(4096, 6144), (4096, 4096), (14336, 4096), (4096, 28672)])
def test_batch_invariant_product_on_cuda_gives_a_row_the_same_bits_alone_and_among_128(depth, columns):
    """The 8B shape's products in bf16: every row of a 128-row product equal, bit for bit, to the same
    row multiplied alone and among 7 (cuBLAS does not promise this), and close to cuBLAS's result."""
    from tokenswift_trt.kernels.triton_linear import linear

    generator = torch.Generator(device="cuda").manual_seed(depth + columns)
    x = torch.randn(128, depth, generator=generator, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(columns, depth, generator=generator, device="cuda") * 0.02).to(torch.bfloat16)
    out = linear(x, weight)
    reference = torch.nn.functional.linear(x, weight).float()
    assert ((out.float() - reference).norm() / reference.norm()) <= 1e-2
    for row in (0, 5, 77, 127):
        assert torch.equal(linear(x[row : row + 1], weight)[0], out[row])
    assert torch.equal(linear(x[:7], weight), out[:7])
