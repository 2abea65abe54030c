"""Every environment variable tokenswift-trt reads, in one place.

Kernel and fusion choices are settings (kernels/config.py: `--kernel NAME=VALUE`, the engine
manifest), never environment variables. What stays in the environment are paths and what is handed
on to child processes:

| variable | meaning |
|---|---|
| `TOKENSWIFT_HOME` | where `build` looks for a preset's checkpoint (`$TOKENSWIFT_HOME/<preset>`) |
| `TOKENSWIFT_TRT_PLUGINS` | the TensorRT plugin library (default: `make plugins`' output in the checkout) |
| `TORCH_EXTENSIONS_DIR` | where torch keeps compiled extensions; `serve` gives tritonserver its own |
| `GPU_CHECK_COMMAND` | the command line a GPU check run records as its own (set by scripts/gpu_checks.sh) |
| `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` | torchrun's |
| `TORCH_NCCL_ASYNC_ERROR_HANDLING` | PyTorch's; `serve --tp` on GPUs sets 2 (a failed collective raises) |

Every other module reads the environment through the functions here.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

HOME = "TOKENSWIFT_HOME"
TRT_PLUGINS = "TOKENSWIFT_TRT_PLUGINS"
TORCH_EXTENSIONS_DIR = "TORCH_EXTENSIONS_DIR"
GPU_CHECK_COMMAND = "GPU_CHECK_COMMAND"
# the six a torch.distributed launcher (torchrun) sets for each rank
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
VARIABLES = {
    HOME: "where `build` looks for a preset's checkpoint ($TOKENSWIFT_HOME/<preset>)",
    TRT_PLUGINS: "the TensorRT plugin library (default: `make plugins`' output in the checkout)",
    TORCH_EXTENSIONS_DIR: "where torch keeps compiled extensions; `serve` gives tritonserver its own",
    GPU_CHECK_COMMAND: "the command line a GPU check run records as its own (set by scripts/gpu_checks.sh)",
    RANK: "this process's rank among those a torch.distributed launcher (torchrun) started",
    WORLD_SIZE: "how many ranks the launcher started",
    LOCAL_RANK: "this process's rank on its node (its GPU)",
    LOCAL_WORLD_SIZE: "how many of the ranks run on this node (`batch` shares its CPUs among them)",
    MASTER_ADDR: "the rendezvous address of the ranks",
    MASTER_PORT: "the rendezvous port of the ranks",
    NCCL_ERROR_HANDLING: "PyTorch's; `serve --tp` on GPUs sets 2 (unless given): a failed collective raises",
}


def _path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def checkpoint_home() -> Path | None:
    """$TOKENSWIFT_HOME, or None where it is not set."""
    return _path(HOME)


def plugin_library() -> Path | None:
    """$TOKENSWIFT_TRT_PLUGINS, or None where it is not set."""
    return _path(TRT_PLUGINS)


def gpu_check_command() -> str | None:
    """$GPU_CHECK_COMMAND, or None where it is not set."""
    return os.environ.get(GPU_CHECK_COMMAND) or None


def launcher_assignment() -> tuple[int, int, int, str | None, int | None] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) as a torch.distributed launcher set
    them (LOCAL_RANK defaults to RANK; address and port None where unset), or None outside one."""
    if RANK not in os.environ or WORLD_SIZE not in os.environ:
        return None
    rank = int(os.environ[RANK])
    port = os.environ.get(MASTER_PORT)
    return (
        rank,
        int(os.environ[WORLD_SIZE]),
        int(os.environ.get(LOCAL_RANK, rank)),
        os.environ.get(MASTER_ADDR),
        int(port) if port else None,
    )


def launcher_local_size() -> int:
    """How many of the launcher's processes share this node (LOCAL_WORLD_SIZE; 1 outside a launcher)."""
    return int(os.environ.get(LOCAL_WORLD_SIZE) or os.environ.get(WORLD_SIZE) or 1)


def child_environment() -> dict[str, str]:
    """A copy of this process's environment, to start a child process with (tritonserver, a GPU check's
    stages)."""
    return dict(os.environ)


def raise_on_failed_collectives() -> None:
    """Have NCCL abort a failed or timed-out collective's communicator and raise, so that the process
    (a Triton model instance) lives on; a value already given is kept."""
    os.environ.setdefault(NCCL_ERROR_HANDLING, "2")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` knows elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_meta() -> dict[str, Any]:
    """The machine, Python and PyTorch a figure was measured with, and the date (a report's meta)."""
    import datetime

    import torch

    from tokenswift_trt.decode.threads import usable_cpus

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu": cpu_model(),
        "cpus": usable_cpus(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
