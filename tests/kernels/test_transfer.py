"""Host-to-device copies in the decode loop are queued, not waited for."""

from __future__ import annotations

import warnings

import pytest
import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.kernels.transfer import copy_from_host, to_device
from tokenswift_trt.model.sampling import SamplingConfig

from conftest import quiet_load

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch"
)


@pytest.mark.parametrize("values", [[3, 1, 2], [[1, 0], [0, 1]], torch.tensor([[True, False]])])
def test_to_device_equals_torch_tensor(values):
    dtype = torch.bool if isinstance(values, torch.Tensor) else torch.long
    expected = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    moved = to_device(values, dtype, "cpu")
    assert moved.dtype == dtype and torch.equal(moved, expected)


def test_copy_from_host_fills_the_target():
    target = torch.zeros(2, 3, dtype=torch.bool)
    copy_from_host(target, torch.tensor([[True, False, True], [False, True, False]]))
    assert target.tolist() == [[True, False, True], [False, True, False]]


@needs_cuda
def test_to_device_does_not_wait_for_the_gpu():
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        busy = busy @ busy  # queued work the copy must not wait for
        moved = to_device([5, 6, 7], torch.long, "cuda")
        target = torch.zeros(3, dtype=torch.long, device="cuda")
        copy_from_host(target, torch.tensor([1, 2, 3]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert moved.device.type == "cuda" and moved.tolist() == [5, 6, 7] and target.tolist() == [1, 2, 3]


@needs_cuda
def test_a_tokenswift_iteration_waits_for_the_gpu_at_most_twice(llama_dir):
    """The candidates' read and the node samples' read are the only host waits per iteration."""
    engine = quiet_load(llama_dir[0], device="cuda", dtype=torch.bfloat16)
    config = GenerationConfig(
        max_new_tokens=40,
        sampling=SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=16),
        tree="1,3,3",
        ngram_topk=4,
        kv_budget=24,
        seed=3,
        ignore_eos=True,
    )
    generate(engine, list(range(5, 40)), config)  # graph captures and first-use work outside the count
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, stats = generate(engine, list(range(5, 40)), config)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    waits = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(waits) <= 2 * stats.iterations + 4  # + prefill and the first token
