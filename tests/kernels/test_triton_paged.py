"""The batch's paged tree attention (kernels/triton_paged.py): one launch for requests of different
lengths and trees equals the PyTorch reference, through Triton's interpreter on the CPU where Triton is
installed and compiled on a GPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tokenswift_trt.kernels.ops import paged_tree_attention_reference

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:  # Triton reads this when it is first imported
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU: its interpreter runs the program on CPU tensors
try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip(
        "Triton comes with CUDA builds of PyTorch (pip install triton for its interpreter)",
        allow_module_level=True,
    )

from helpers import paged_batch  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_launch_for_the_batch_equals_the_reference(dtype):
    from tokenswift_trt.kernels.triton_paged import paged_tree_attention

    device = "cuda" if ON_GPU else "cpu"
    query, pool, tables, prefixes, counts, words, _ = paged_batch(torch.Generator().manual_seed(3))
    args = [
        query.to(device, dtype),
        pool.keys[0].to(device, dtype),
        pool.values[0].to(device, dtype),
        tables.to(device),
        prefixes.to(device),
        counts.to(device),
        words.to(device),
        0.25,
    ]
    out = paged_tree_attention(*args)
    expected = paged_tree_attention_reference(*args)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
