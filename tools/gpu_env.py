"""The machine a prepared check runs on: GPU, driver, torch and CUDA, copy bandwidth, our kernels' build.

    python -m tools.gpu_env --device cuda --out env.json

Run as the first stage of `tools.gpu_check`, in its own process: building the CUDA
kernels here (torch caches the build on disk) keeps the compile out of the later stages' timings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any


def nvidia_smi() -> dict[str, str]:
    """GPU name, driver and memory as nvidia-smi reports them ({} where it is absent or fails)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.splitlines()[0]
    except (subprocess.SubprocessError, OSError, IndexError):
        return {}
    name, driver, memory = (field.strip() for field in line.split(",", 2))
    return {"gpu": name, "driver": driver, "gpu_memory": memory}


def probe(device: str) -> dict[str, Any]:
    """What the machine is and how fast it copies; on CUDA also builds and loads our kernels."""
    import torch

    from tokenswift_trt.bench.steps import measure_copy_bandwidth

    record: dict[str, Any] = {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        **nvidia_smi(),
    }
    target = torch.device(device)
    if target.type == "cuda":
        properties = torch.cuda.get_device_properties(target)
        record.update(cuda_device=properties.name, multiprocessors=properties.multi_processor_count)
        from tokenswift_trt.kernels import ops as kernels

        start = time.perf_counter()
        status = kernels.load_cuda_kernels(verbose=False)
        record.update(
            kernels_loaded=status.loaded,
            kernels_reason=status.reason,
            kernels_build_s=round(time.perf_counter() - start, 1),
        )
    megabytes = 1024 if target.type == "cuda" else 64
    record["copy_bandwidth_gb_s"] = round(measure_copy_bandwidth(target, megabytes) / 1e9, 2)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    record = probe(args.device)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    for key, value in record.items():
        print(f"{key}: {value}")
    if args.device.startswith("cuda") and not record.get("kernels_loaded"):
        print(f"error: our CUDA kernels did not load: {record.get('kernels_reason')}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
