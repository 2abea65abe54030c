"""`--tp N`: the ranks of a tensor-parallel run and what they agree on (docs/deploy.md, "Tensor parallelism").

Two ways in, one code path after: under `torchrun` (its RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, the torch.distributed launch protocol) every process is a rank; without it, the process
the user started is rank 0 and starts ranks 1..N-1 itself, each running the same command
(a `python -c` process each, given the command's parameters). Every rank then
- checks the size against the model's heads (one line, before anything starts or loads),
- joins a gloo (CPU) or NCCL (GPU) group with a timeout, so that a rank that dies or hangs ends the
  others with an error instead of a hang,
- compares the size, the model's config, dtype and kernel settings with the others (one line on a
  mismatch, before any weight loads),
- loads only its slices (model/tensor_parallel.py) and takes rank 0's request settings: the seed, and
  under `--tree auto` the tuner's probe plan held fixed (the tuner decides from each rank's own
  timings, which differ: ranks would diverge),
- checks after each iteration that every rank committed the same tokens.
Only rank 0 prints and writes the journal.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from tokenswift_trt.decode.threads import usable_cpus

LOCALHOST = "127.0.0.1"
ERROR_PREFIX = "tokenswift-trt: error: "
JOIN_S = 30.0  # how long rank 0 waits for the ranks it started to exit once it is done
RANK_ENTRY = "from tokenswift_trt.cli.tp_launch import _rank_main; _rank_main()"


@dataclass(frozen=True)
class Assignment:
    """A process's place in the run: its rank of `size` and the rendezvous address."""

    rank: int
    size: int
    local_rank: int
    address: str
    port: int


_ASSIGNED: Assignment | None = None  # set in the ranks `launch` starts, before their command runs


def _from_torchrun() -> Assignment | None:
    """The assignment torchrun (or any torch.distributed launcher) gives in the environment."""
    from tokenswift_trt.environment import launcher_assignment

    given = launcher_assignment()
    if given is None:
        return None
    rank, size, local_rank, address, port = given
    return Assignment(rank, size, local_rank, address or LOCALHOST, port or 29500)


def launched_ranks() -> int:
    """How many processes a torch.distributed launcher (torchrun) started this one among (1: none)."""
    assignment = _from_torchrun()
    return assignment.size if assignment is not None else 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOCALHOST, 0))
        return int(probe.getsockname()[1])


class RankError(click.ClickException):
    """A tensor-parallel rank stopped or timed out before the generation began."""

    exit_code = 2


class _ErrorsOnly:
    """stderr of a rank other than 0: only its one-line error passes, naming the rank, and only once the
    ranks have agreed (an error every rank meets before, rank 0 reports alone)."""

    def __init__(self, stream: Any, rank: int) -> None:
        self.stream, self.rank = stream, rank
        self.enabled = False

    def write(self, text: str) -> int:
        if self.enabled and text.startswith(ERROR_PREFIX):
            self.stream.write(f"{ERROR_PREFIX}rank {self.rank}: {text[len(ERROR_PREFIX) :]}")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def _silence(rank: int) -> None:
    """Ranks other than 0 print nothing but their own error line."""
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    sys.stderr = _ErrorsOnly(sys.__stderr__, rank)


def _rank_main() -> None:
    """Entry of a rank started by `launch` (`RANK_ENTRY`): the same command with the same parameters,
    read pickled from stdin."""
    global _ASSIGNED
    command, params, assignment = pickle.load(sys.stdin.buffer)
    _ASSIGNED = assignment
    _silence(assignment.rank)
    module, name = command
    target = getattr(importlib.import_module(module), name)
    try:
        with click.Context(target, info_name=target.name) as ctx:
            ctx.invoke(target.callback, **params)
    except click.ClickException as error:
        sys.stderr.write(f"{ERROR_PREFIX}{error.format_message()}\n")
        sys.exit(error.exit_code)
    except Exception as error:  # noqa: BLE001 (a rank's unexpected failure, said in one line)
        sys.stderr.write(f"{ERROR_PREFIX}{type(error).__name__}: {_first_line(error)}\n")
        sys.exit(1)


@dataclass
class Ranks:
    """This process's rank of a started tensor-parallel run and the ranks it started (rank 0 without
    torchrun)."""

    tp: Any  # tokenswift_trt.model.tensor_parallel.TensorParallel
    device: str
    started: list[subprocess.Popen] = field(default_factory=list)

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def agree(self, config: Any) -> Any:
        """Rank 0's GenerationConfig on every rank, its seed fixed (a seed drawn on each rank would
        differ) and `--tree auto` replaced by the tuner's probe plan, held fixed."""
        from tokenswift_trt.decode.autotune import probe_plan
        from tokenswift_trt.decode.request import with_fixed_seed

        if self.leader:
            config = with_fixed_seed(config)
            if config.tree.auto:
                source = config.resolved_draft_source
                tree, topk = probe_plan(source, _device(self.device))
                config = dataclasses.replace(config, tree=tree, ngram_topk=topk, draft_source=source)
        return self._collective(lambda: self.tp.broadcast(config))

    def with_memory(self, config: Any) -> Any:
        """Without a memory budget: the least any rank has free (ranks admit alike or refuse alike)."""
        from tokenswift_trt.decode.admission import available_bytes

        if config.memory_budget is not None:
            return config
        free = available_bytes(_device(self.device))
        rows = self._collective(lambda: self.tp.gather([free], self._on()))
        return dataclasses.replace(config, memory_budget=min(row[0] for row in rows))

    def _collective(self, run: Any) -> Any:
        """`run()`, a rank that stopped or timed out in it said in one line."""
        try:
            return run()
        except RuntimeError as error:
            raise RankError(f"a tensor-parallel rank stopped or timed out: {_first_line(error)}") from None

    def check_tokens(self, ids: list[int]) -> None:
        """Raise unless every rank committed these same tokens (once per iteration)."""
        from tokenswift_trt.model.tensor_parallel import TensorParallelError

        digest = 0
        for token in ids:
            digest = (digest * 1_000_003 + token + 1) % (1 << 61)
        rows = self.tp.gather([len(ids), digest], self._on())
        if any(row != rows[0] for row in rows):
            raise TensorParallelError(
                "tensor-parallel ranks committed different tokens (their logits differ); please report "
                "the command (docs/deploy.md, Tensor parallelism)"
            )

    def _on(self) -> str:
        """Where collectives' tensors live: the GPU under NCCL, else the host."""
        return self.device if self.device.startswith("cuda") else "cpu"

    def close(self) -> None:
        """Leave the group; wait a while for the ranks this process started to finish, then stop them
        (at once when the command is failing: a hung rank would never finish)."""
        import torch.distributed as dist

        failing = sys.exc_info()[0] is not None  # called as the command's context exits
        if dist.is_initialized():
            dist.destroy_process_group()
        for process in self.started:
            try:
                process.wait(0 if failing else JOIN_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _device(name: str) -> Any:
    import torch

    return torch.device(name)


def launch(
    size: int, timeout_s: float, model_dir: Path, dtype: str | None, device: str, kernels: dict[str, Any]
) -> Ranks:
    """Check `size` against the model, start or join the ranks, and compare what every rank was asked
    to run; raise TensorParallelError (one line) on any mismatch, before any weight loads."""
    from tokenswift_trt.model.config import load_config
    from tokenswift_trt.model.tensor_parallel import config_digest

    asked = {"model": config_digest(model_dir), "--dtype": dtype, "--kernel": sorted(kernels.items())}
    return start_ranks(size, timeout_s, load_config(model_dir), asked, device)


def start_ranks(size: int, timeout_s: float, config: Any, asked: dict[str, Any], device: str) -> Ranks:
    """`launch` for a model's `config` (ModelConfig): the ranks compare `asked` (what names the model
    and its settings) and the size."""
    import torch

    from tokenswift_trt.model.tensor_parallel import TensorParallelError, check_size, init_group

    assignment = _ASSIGNED or _from_torchrun()
    if assignment is not None and assignment.rank:
        _silence(assignment.rank)
    check_size(config, size)
    started: list[subprocess.Popen] = []
    if assignment is None:  # no launcher: this process is rank 0 and starts the others
        assignment = Assignment(0, size, 0, LOCALHOST, _free_port())
        context = click.get_current_context()
        module = context.command.callback.__module__
        main_spec = getattr(sys.modules["__main__"], "__spec__", None)
        if module == "__main__" and main_spec is not None:  # run as `python -m NAME`: ranks import NAME
            module = main_spec.name
        command = (module, context.command.callback.__name__)
        for rank in range(1, size):
            place = dataclasses.replace(assignment, rank=rank, local_rank=rank)
            process = subprocess.Popen(
                [sys.executable, "-c", RANK_ENTRY], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
            )
            assert process.stdin is not None
            process.stdin.write(pickle.dumps((command, dict(context.params), place)))
            process.stdin.close()
            started.append(process)
    if _from_torchrun() is None:
        # ranks started here share this machine's cores equally (torchrun sets OMP_NUM_THREADS itself)
        torch.set_num_threads(max(1, usable_cpus() // size))
    backend = "gloo"
    if device.startswith("cuda"):
        gpus = torch.cuda.device_count()
        if gpus < size:
            fix = f"give --tp {gpus} or fewer" if gpus else "run the ranks on the CPU with --device cpu"
            raise TensorParallelError(f"--tp {size} needs {size} GPUs, this node has {gpus}: {fix}")
        backend, device = "nccl", f"cuda:{assignment.local_rank}"
        torch.cuda.set_device(device)
    tp = init_group(assignment.rank, assignment.size, assignment.address, assignment.port, backend, timeout_s)
    ranks = Ranks(tp, device, started)
    try:
        asked = {"--tp": size, **asked}
        try:
            every = tp.gather_objects(asked)
        except RuntimeError as error:
            raise RankError(f"tensor-parallel ranks did not all start: {_first_line(error)}") from None
        for name in asked:
            values = [row[name] for row in every]
            if any(value != values[0] for value in values):
                raise TensorParallelError(
                    f"tensor-parallel ranks disagree on {name}: "
                    + ", ".join(f"rank {rank} {value}" for rank, value in enumerate(values))
                    + ": start every rank with the same command"
                )
        if assignment.size != size:
            raise TensorParallelError(
                f"--tp {size} but the launcher started {assignment.size} processes: give torchrun "
                f"--nproc-per-node {size} (or --tp {assignment.size})"
            )
    except BaseException:
        ranks.close()
        raise
    if isinstance(sys.stderr, _ErrorsOnly):
        sys.stderr.enabled = True  # from here on, an error may be this rank's own
    return ranks


def tp_options(function):
    """`--tp N` and `--tp-timeout S`: tensor-parallel ranks and how long a collective waits for one."""
    function = click.option(
        "--tp-timeout",
        type=click.FloatRange(min=1.0),
        default=120.0,
        show_default=True,
        help="seconds a tensor-parallel rank waits for the others before the run fails (a rank died or "
        "hangs)",
    )(function)
    return click.option(
        "--tp",
        type=click.IntRange(1),
        default=1,
        show_default=True,
        help="tensor-parallel ranks: the model's layers split over N processes (one per GPU; gloo on a "
        "CPU); under torchrun, its --nproc-per-node; without it, the ranks are started here",
    )(function)
