"""Host values to the device without waiting for the GPU.

A copy from ordinary (pageable) host memory to a CUDA device first waits for everything already
queued on the stream, so each small `torch.tensor(values, device="cuda")` in the decode loop
stalls the host until the GPU is idle. Staged in pinned memory, the copy is queued like a kernel
(PyTorch's pinned-memory cache keeps the buffer alive until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` that does not synchronise on CUDA."""
    device = torch.device(device)
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_from_host(target: torch.Tensor, values: torch.Tensor) -> None:
    """`target.copy_(values)` for a host tensor, without waiting for the GPU when target is on CUDA."""
    if target.device.type == "cuda":
        target.copy_(values.pin_memory(), non_blocking=True)
    else:
        target.copy_(values)
