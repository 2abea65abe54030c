"""`bench-steps` as library calls: a model shape with random weights, its measured step costs, the
speedup they imply and the report (steps.csv, speedup.csv, steps.json).

    job = StepBenchJob(model="llama3.1-8b", contexts=(4096, 32768), tree_sizes=(1, 41), device="cuda")
    result = run_step_bench(job)            # measured, modeled, written under job.out

The CLI's `bench-steps` is these calls plus printing. Every failure is a `StepBenchError` (or another
`ValueError`) whose first line names the figure to change.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.engine import KernelFallbackWarning

from .host import reference_host_ms
from .metrics import PAPER_ACCEPT_LENGTH
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
