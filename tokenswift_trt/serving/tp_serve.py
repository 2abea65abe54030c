"""`serve --tp N`: one model instance spanning N tensor-parallel ranks (docs/serving.md).

The Triton model is rank 0. It starts ranks 1..N-1 as worker processes (`python -c`, like
`generate --tp N`, cli/tp_launch.py), each loading its slices of the same model. Per request rank 0
broadcasts the prompt ids and the settings (its seed fixed, `--tree auto` held at the tuner's probe
plan) and every rank runs the same generate loop in step; the workers discard their tokens, rank 0
streams and journals. Jobs go over a second gloo group without a timeout (a worker waits for
requests as long as the server is idle); the model's collectives keep `--tp-timeout`, so a worker
that dies or hangs mid-request fails that request within it. A failed request leaves the group
broken: the next request stops the workers, forms a new group and starts them again.

With batching (`serve --tp N`, the default `--max-batch`), rank 0 sends the workers one job, "batch",
and from then on every rank runs a `Scheduler` in lockstep (decode/scheduler.py): before each step
rank 0's scheduler broadcasts the requests that joined and left since the last one and its planner's
choice over the job group (`JobLockstep`), and every rank runs the same batched forward. A failed
step fails the requests in flight and leaves the group broken, formed again before the next step.

On the CPU the model's group is gloo; with `--device cuda` it is NCCL, rank r on `cuda:r` (the node
needs N GPUs, checked by `serve` before anything loads). NCCL's watchdog is told to abort a failed
or timed-out collective's communicator without ending the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=2,
unless the environment sets it), so that the Triton model, rank 0, survives a worker's death and forms
a new group for the next request as on the CPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenswift_trt.decode.threads import usable_cpus
from tokenswift_trt.environment import raise_on_failed_collectives

LOCALHOST = "127.0.0.1"
WORKER_ENTRY = "from tokenswift_trt.serving.tp_serve import _worker_main; _worker_main()"
IDLE = datetime.timedelta(days=365)  # the job group waits for the next request this long


@dataclass(frozen=True)
class Place:
    """What a worker needs to join: its rank, the group's size and rendezvous, how to load the model."""

    rank: int
    size: int
    port: int
    timeout_s: float
    source: str
    device: str
    kernels: str


def rank_device(device: str, rank: int) -> str:
    """Where rank `rank` runs: `cuda:rank` under `--device cuda` (one GPU per rank), else `device`."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def load_model(source: str | Path, device: str, kernels: str, tp: Any) -> Any:
    """This rank's engine of an engine directory or a model directory (as `Session` loads it)."""
    import torch

    from tokenswift_trt.backends.loader import load_engine_dir
    from tokenswift_trt.kernels.config import KernelConfig, parse_kernel_settings
    from tokenswift_trt.model.engine import load_engine
    from tokenswift_trt.model.engine_dir import MANIFEST

    source = Path(source)
    settings = parse_kernel_settings(item for item in kernels.split(";") if item.strip())
    if device == "cpu":  # the rank's share of the CPUs, as set when it started
        settings.setdefault("threads", str(torch.get_num_threads()))
    if (source / MANIFEST).is_file():
        return load_engine_dir(source, device=device, kernels=settings, tp=tp)[0]
    return load_engine(source, device=device, kernels=KernelConfig().updated(settings), tp=tp)


def _join(place: Place) -> tuple[Any, Any]:
    """Form the default group (the model's collectives, with the timeout: gloo, or NCCL on GPUs) and
    the job group (gloo)."""
    import torch
    import torch.distributed as dist

    from tokenswift_trt.model.tensor_parallel import init_group

    backend = "gloo"
    if place.device.startswith("cuda"):
        backend = "nccl"
        torch.cuda.set_device(rank_device(place.device, place.rank))
        raise_on_failed_collectives()  # a failed collective raises; the process lives on
    tp = init_group(place.rank, place.size, LOCALHOST, place.port, backend, place.timeout_s)
    jobs = dist.new_group(backend="gloo", timeout=IDLE)
    return tp, jobs


def _broadcast(value: Any, group: Any) -> Any:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _step_check(tp: Any, device: str) -> Callable[[list[int]], None]:
    """An on_tokens that checks every rank committed the same tokens (once per iteration; the
    collective's tensors on `device`: NCCL reduces GPU tensors only)."""
    from tokenswift_trt.decode.scheduler import token_digest
    from tokenswift_trt.model.tensor_parallel import TensorParallelError

    def check(ids: list[int]) -> None:
        rows = tp.gather([len(ids), token_digest(0, ids)], device)
        if any(row != rows[0] for row in rows):
            raise TensorParallelError(
                "tensor-parallel ranks committed different tokens (their logits differ)"
            )

    return check


def _exit_with_parent() -> None:
    """End this worker when rank 0 goes (its end of stdin closes)."""

    def watch() -> None:
        while sys.stdin.buffer.read(1 << 16):
            pass
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main() -> None:
    """A worker rank: join, load its slices, then run every job rank 0 broadcasts until told to stop."""
    import torch

    from tokenswift_trt.decode.loop import generate

    place: Place = pickle.load(sys.stdin.buffer)
    _exit_with_parent()
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    torch.set_num_threads(max(1, usable_cpus() // place.size))
    tp, jobs = _join(place)
    device = rank_device(place.device, place.rank)
    engine = load_model(place.source, device, place.kernels, tp)
    check = _step_check(tp, device)
    while (job := _broadcast(None, jobs)) is not None:
        if job[0] == BATCH:  # from now on: a scheduler in lockstep with rank 0's
            from tokenswift_trt.decode.scheduler import Scheduler

            _, max_batch, memory_budget = job
            scheduler = Scheduler(engine, max_batch, memory_budget, lockstep=JobLockstep(jobs, leader=False))
            while True:
                scheduler.step()
        prompt_ids, config = job
        generate(engine, prompt_ids, config, on_tokens=check)


BATCH = "batch"  # the job that turns a worker into a lockstep scheduler


class JobLockstep:
    """`decode.scheduler.Lockstep` over the job group: rank 0 broadcasts each step's job."""

    def __init__(self, jobs: Any, leader: bool) -> None:
        self.jobs, self.leader = jobs, leader

    def exchange(self, job: Any) -> Any:
        return _broadcast(job, self.jobs)


def tp_config(config: Any, device: str) -> Any:
    """A request's config as every rank runs it: its seed fixed, and `--tree auto` held at the tuner's
    probe plan (a tuner decides from its own rank's timings)."""
    from tokenswift_trt.decode.autotune import probe_plan
    from tokenswift_trt.decode.request import with_fixed_seed

    config = with_fixed_seed(config)
    if config.tree.auto:
        import torch

        source = config.resolved_draft_source
        tree, topk = probe_plan(source, torch.device(device))
        config = dataclasses.replace(config, tree=tree, ngram_topk=topk, draft_source=source)
    return config


class RankGroup:
    """Rank 0's side: the workers it started and supervises, and the per-request broadcast."""

    def __init__(self, size: int, timeout_s: float, source: str, device: str, kernels: str, python: str):
        self.size, self.timeout_s, self.python = size, timeout_s, python
        self.source, self.asked, self.kernels = source, device, kernels
        self.device = rank_device(device, 0)  # rank 0's: this process's
        self.workers: list[subprocess.Popen] = []
        self.tp: Any = None
        self.jobs: Any = None
        self.broken = False

    def start(self) -> Any:
        """Start the workers and form the group; this rank's TensorParallel."""
        import torch

        from tokenswift_trt.serving.server import free_port

        port = free_port()
        for rank in range(1, self.size):
            place = Place(rank, self.size, port, self.timeout_s, self.source, self.asked, self.kernels)
            process = subprocess.Popen(
                [self.python, "-c", WORKER_ENTRY], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
            )
            assert process.stdin is not None
            process.stdin.write(pickle.dumps(place))
            process.stdin.flush()  # stdin stays open: the worker exits when it closes
            self.workers.append(process)
        torch.set_num_threads(max(1, usable_cpus() // self.size))
        place = Place(0, self.size, port, self.timeout_s, self.source, self.asked, self.kernels)
        self.tp, self.jobs = _join(place)
        self.broken = False
        return self.tp

    def stop(self) -> None:
        """Stop the workers and leave the group."""
        import torch.distributed as dist

        for process in self.workers:
            process.kill()
            process.wait()
            if process.stdin is not None:
                process.stdin.close()
        self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()

    def run(
        self, generate: Callable[..., Any], engine: Any, prompt_ids: list[int], config: Any, on_tokens: Any
    ):
        """`generate(engine, prompt_ids, config, on_tokens=...)` on every rank in step; any failure
        leaves the group to be formed again before the next request."""
        if self.broken:
            self.stop()
            self.start()  # the engine's collectives use the default group: the new one
        config = tp_config(config, self.device)
        check = _step_check(self.tp, self.device)

        def each(ids: list[int]) -> None:
            check(ids)
            on_tokens(ids)

        self.broken = True
        try:
            _broadcast((prompt_ids, config), self.jobs)
            result = generate(engine, prompt_ids, config, on_tokens=each)
        except RuntimeError as error:  # a worker died or timed out in a collective
            line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise TensorParallelStopped(f"a tensor-parallel rank stopped or timed out: {line}") from None
        self.broken = False
        return result

    def start_batching(self, max_batch: int, memory_budget: int) -> JobLockstep:
        """Turn the workers into lockstep schedulers (forming the group again first where a failure
        broke it); rank 0's scheduler leads with the returned lockstep."""
        if self.broken:
            self.stop()
            self.start()
        _broadcast((BATCH, max_batch, memory_budget), self.jobs)
        return JobLockstep(self.jobs, leader=True)


class TensorParallelStopped(RuntimeError):
    """A worker rank died or hung during a request (the next request starts the workers again)."""
