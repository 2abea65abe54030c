"""`bench-steps` as library calls: a model shape with random weights, its measured step costs, the
speedup they imply and the report (steps.csv, speedup.csv, steps.json, steps.png); with tensor
parallelism, one rank's step cost and its all-reduces' share (tp_steps.csv, tp_steps.json).

    job = StepBenchJob(model="llama3.1-8b", contexts=(4096, 32768), tree_sizes=(1, 41), device="cuda")
    result = run_step_bench(job)            # measured, modeled, written under job.out

The CLI's `bench-steps` is these calls plus printing. Every failure is a `StepBenchError` (or another
`ValueError`) whose first line names the figure to change.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.builder.build import BuildRequest, resolve
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.config import ModelConfig, config_from_dict, load_config
from tokenswift_trt.model.engine import KernelFallbackWarning

from .host import reference_host_ms
from .metrics import PAPER_ACCEPT_LENGTH
from .report import machine_meta
from .steps import (
    DEFAULT_GEN_LENGTHS,
    DEFAULT_PROMPT_LENGTH,
    VERIFY_TREE_CAP,
    ModeledSpeedup,
    StepBenchError,
    StepCost,
    check_step_request,
    device_description,
    measure_accept_lengths,
    measure_copy_bandwidth,
    measure_step_costs,
    modeled_speedup,
    random_engine,
    write_step_report,
)
from .tp_steps import TpStepCost, measure_tp_steps, random_rank_model, write_tp_report


@dataclass(frozen=True)
class StepBenchJob:
    """What `bench-steps` is asked (its flags, parsed)."""

    model: str  # a preset name or a model directory whose shape is timed (random weights)
    contexts: tuple[int, ...]  # cached positions L
    tree_sizes: tuple[int, ...]  # tokens T per verify pass
    gen_lens: tuple[int, ...] = DEFAULT_GEN_LENGTHS  # generation lengths modeled
    prompt_length: int = DEFAULT_PROMPT_LENGTH  # prompt length modeled
    accept_length: float = PAPER_ACCEPT_LENGTH  # τ of partial-cache drafting
    verify_accept_length: float | None = None  # τ of verify-pass drafting (None: accept_length, at most 4)
    acceptance_from: Path | None = None  # a trained model directory whose measured τ replaces both
    verify_tree_size: int | None = None  # T of the modeled verify pass (None: the largest tree size)
    host_overhead_ms: float | None = None  # host time per iteration (None: measured by a short generation)
    step_repeats: int = 20  # timed runs per step (median)
    kv_budget: int | None = None  # partial KV cache budget B (None: generation's default)
    dtype: str | None = None  # None: the preset's, float32 for a model directory
    device: str = "cpu"
    compile_steps: bool = False  # fixed-shape steps through torch.compile
    kernels: dict[str, Any] = field(default_factory=dict)  # KernelConfig fields over the defaults
    out: Path = Path("runs/steps")
    command: str = "tokenswift-trt bench-steps"  # recorded in the report
    # --tp: the LM head replicated or split over the vocabulary (HEAD_MODES; None: the backend's default)
    tp_head: str | None = None


@dataclass
class StepBenchResult:
    """Measured step costs, the speedups they imply and what the report records (`meta`)."""

    costs: list[StepCost]
    speedups: list[ModeledSpeedup]
    meta: dict[str, Any]  # as written into steps.json (before the machine's description is added)
    written: list[Path]
    bandwidth: float  # measured copy bandwidth, bytes/s
    accept_length: float  # τ of partial-cache drafting, as modeled
    verify_accept_length: float  # τ of verify-pass drafting, as modeled
    tree_size: int  # T of the modeled verify pass
    host_overhead_ms: float

    @property
    def extrapolated(self) -> tuple[int, int] | None:
        """(largest measured context, longest modeled context) where the model reaches 25% or more
        beyond what was measured; None where the measured contexts cover it."""
        measured = max(cost.context for cost in self.costs)
        needed = self.meta["prompt_length"] + max(s.gen_length for s in self.speedups)
        return (measured, needed) if needed > 1.25 * measured else None


def check_cuda(device: str) -> None:
    """A one-line error where `device` is CUDA and this torch cannot run on one."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        reason = "this torch is CPU-only" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise StepBenchError(
            f"bench-steps: --device cuda needs a CUDA GPU and a CUDA build of torch ({reason})"
        )


def run_step_bench(
    job: StepBenchJob,
    on_step: Callable[[StepCost], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> StepBenchResult:
    """Build the random-weights engine, measure its steps, model the speedup and write the report under
    `job.out`. `on_step(cost)` follows every measured step; `note(line)` gets what a user should read
    while it runs (kernel fallbacks, measured τ and host time)."""
    say: Callable[[str], None] = note or (lambda line: None)
    check_cuda(job.device)
    contexts, sizes = job.contexts, job.tree_sizes
    tree_size = job.verify_tree_size or max(sizes)
    if tree_size not in sizes:
        raise StepBenchError(
            f"--verify-tree-size {tree_size} is not among --tree-sizes {','.join(map(str, sizes))}"
        )
    accept_length = job.accept_length
    # verify-pass drafting runs tree 3,3,3: by default the same τ, at most what that tree commits
    verify_tau = (
        min(accept_length, VERIFY_TREE_CAP) if job.verify_accept_length is None else job.verify_accept_length
    )
    if job.acceptance_from is not None:
        if not job.acceptance_from.is_dir():
            raise StepBenchError(f"--acceptance-from: model directory {job.acceptance_from} does not exist")
        accept_length, verify_tau = measure_accept_lengths(job.acceptance_from)
        say(
            f"measured on {job.acceptance_from}: τ {accept_length:.3f} (partial-cache drafting, tree "
            f"1,3,3,3), {verify_tau:.3f} (verify-pass drafting, tree 3,3,3)"
        )
    if (
        min(accept_length, verify_tau) < 1
        or job.step_repeats < 1
        or (job.host_overhead_ms or 0) < 0
        or job.prompt_length < 1
    ):
        raise StepBenchError(
            "--accept-length and --verify-accept-length must be >= 1, --step-repeats and --prefix-len "
            ">= 1, --host-overhead-ms >= 0"
        )
    kv_budget = job.kv_budget or GenerationConfig(max_new_tokens=1).kv_budget
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KernelFallbackWarning)
        try:
            engine, dtype_name = random_engine(
                job.model,
                getattr(torch, job.dtype) if job.dtype else None,
                job.device,
                kernels=KernelConfig().updated(job.kernels),
            )
        except RuntimeError as error:  # too little memory, CUDA errors
            raise StepBenchError(str(error)) from None
    for warning in caught:
        say(f"warning: {warning.message}")
    check_step_request(engine, contexts, sizes, kv_budget, job.step_repeats)
    bandwidth = measure_copy_bandwidth(engine.device)
    host_measured = job.host_overhead_ms is None
    host_overhead_ms = job.host_overhead_ms
    if host_overhead_ms is None:
        host_overhead_ms = reference_host_ms(engine, kv_budget)
        say(
            f"host overhead: {host_overhead_ms:.3f} ms per iteration (measured: 256 tokens, tree 1,3,3,3, "
            "k=20, min-p 0.1, θ 1.2)"
        )
    costs = measure_step_costs(
        engine,
        contexts,
        sizes,
        kv_budget,
        job.step_repeats,
        bandwidth,
        on_step,
        compile_steps=job.compile_steps,
    )
    speedups = modeled_speedup(
        costs, job.prompt_length, job.gen_lens, accept_length, verify_tau, tree_size, host_overhead_ms / 1e3
    )
    torch_model = engine.model.torch_model
    meta = {
        "command": job.command,
        "model": job.model,
        "random_weights": True,
        "device": device_description(engine.device),
        "dtype": dtype_name,
        "torch": torch.__version__,
        "attention_kernel": torch_model.attention_summary(),
        "fused_elementwise": torch_model.fused_elementwise,
        "batch_invariant": torch_model.batch_invariant,
        "kernels": engine.kernels.to_dict(),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "kv_budget": kv_budget,
        "step_repeats": job.step_repeats,
        "prompt_length": job.prompt_length,
        "accept_length": round(accept_length, 4),
        "verify_accept_length": round(verify_tau, 4),
        "acceptance_from": str(job.acceptance_from) if job.acceptance_from else None,
        "verify_tree_size": tree_size,
        "host_overhead_ms": round(host_overhead_ms, 4),
        "host_overhead_measured": host_measured,
    }
    written = write_step_report(costs, speedups, job.out, meta)
    return StepBenchResult(
        list(costs),
        list(speedups),
        meta,
        written,
        bandwidth,
        accept_length,
        verify_tau,
        tree_size,
        host_overhead_ms,
    )


# ---------------------------------------------------------------- tensor parallel


def model_config(model: str) -> ModelConfig:
    """The config of a preset or a model directory (what `--tp` ranks split), no weights read."""
    preset, directory = resolve(BuildRequest(model=model, out=Path("."), random_weights=True))
    return config_from_dict(preset.config) if preset is not None else load_config(directory)


class TpRankError(RuntimeError):
    """A tensor-parallel rank stopped or timed out while the steps were measured."""


@dataclass
class TpStepBenchResult:
    costs: list[TpStepCost]
    written: list[Path]  # empty on ranks other than 0 (rank 0 writes the report)
    head: str = "replicated"  # how the LM head was split (tensor_parallel.HEAD_MODES)


def tp_dtype(job: StepBenchJob) -> str:
    """The element type `--tp` ranks time in (float32 unless given)."""
    return job.dtype or "float32"


def tp_rank_settings(job: StepBenchJob) -> dict[str, Any]:
    """What every `--tp` rank must agree on before timing (compared across ranks as they start)."""
    return {
        "--model": job.model,
        "--dtype": tp_dtype(job),
        "--kernel": sorted(job.kernels.items()),
        "--tp-head": job.tp_head,
    }


def run_tp_step_bench(
    job: StepBenchJob, config: ModelConfig, tp: Any, device: str, leader: bool, size: int
) -> TpStepBenchResult:
    """`bench-steps --tp N` on this rank of the started group `tp` (model.tensor_parallel.TensorParallel)
    of `size` ranks: every rank times its slice of `config`'s shape (random weights); rank 0 (`leader`)
    writes tp_steps.csv and tp_steps.json under `job.out`. A rank that stops or times out while the
    steps are measured is a `TpRankError`."""
    dtype = tp_dtype(job)
    device_now = torch.device(device)
    settings = KernelConfig().updated(job.kernels)
    tp = dataclasses.replace(tp, head=job.tp_head or tp.head)
    rank_model = random_rank_model(config, tp, getattr(torch, dtype), device_now, settings)
    try:
        costs = measure_tp_steps(rank_model, tp, job.contexts, job.tree_sizes, job.step_repeats)
    except RuntimeError as error:
        raise TpRankError(str(error) or type(error).__name__) from None
    if not leader:
        return TpStepBenchResult(list(costs), [], tp.head)
    meta = {
        "command": f"tokenswift-trt bench-steps --model {job.model} --tp {size} --tp-head {tp.head} "
        f"(contexts {job.contexts}, tree sizes {job.tree_sizes}, {job.step_repeats} repeats)",
        "model": job.model,
        "tp": size,
        "tp_head": tp.head,
        "screened_head": rank_model.screened_head is not None,
        "random_weights": True,
        "dtype": dtype,
        "device": device_description(device_now),
        "backend": "nccl" if device_now.type == "cuda" else "gloo",
        "load_average": round(os.getloadavg()[0], 2),
        **machine_meta(),
    }
    return TpStepBenchResult(list(costs), write_tp_report(costs, job.out, meta), tp.head)
