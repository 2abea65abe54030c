"""tools/gpu_iteration_profile.py: phase times read from the GPU timeline."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType


def load_script():
    from tools import gpu_iteration_profile

    return gpu_iteration_profile


def event(key: str, start: float, end: float, device=DeviceType.CUDA, annotation: bool = False):
    return SimpleNamespace(
        key=key,
        device_type=device,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
    )


def test_device_work_is_counted_in_the_phase_whose_gpu_span_holds_it_triton_kernels_included():
    profile_script = load_script()
    events = [
        event("device_loop.verify", 0, 100),  # the GPU-side span of the label
        event("device_loop.verify", 0, 300, device=DeviceType.CPU),  # its host range: not device work
        event("nvjet_gemm", 10, 30),
        event("_prefix_kernel", 50, 80),  # a Triton kernel, tied to no host op
        event("aten::mm", 12, 14, device=DeviceType.CPU),
        event("device_loop.heads", 100, 120),
        event("nvjet_head", 100, 105),
        event("device_loop.commit", 130, 200),
        event("device_loop.drafts", 140, 160),  # nested in commit: counted in both
        event("draft_gemm", 145, 155),
        event("index_copy", 170, 175),
        event("some_other_annotation", 0, 400, annotation=True),  # not work
    ]
    times = profile_script.device_phase_times(events, iterations=2)
    assert times["verify"] == pytest.approx((20 + 30) / 1e3 / 2)
    assert times["heads"] == pytest.approx(5 / 1e3 / 2)
    assert times["commit"] == pytest.approx((10 + 5) / 1e3 / 2)
    assert times["drafts"] == pytest.approx(10 / 1e3 / 2)
    assert times["accept"] == 0.0 and set(times) == set(profile_script.PHASES)
