"""`bench-steps`: the cost of one AR, draft and verify step of a model shape with random weights, and
the speedup those costs imply."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from tokenswift_trt.bench.metrics import PAPER_ACCEPT_LENGTH

from .common import fail, given_command, int_list, kernel_option, report_out_option

if TYPE_CHECKING:
    from tokenswift_trt.bench.step_bench import StepBenchJob, StepBenchResult
    from tokenswift_trt.bench.steps import StepCost


@click.command("bench-steps")
@click.option(
    "--model", required=True, help="preset name or model directory whose shape is timed (random weights)"
)
@click.option("--contexts", default="4096,32768,65536,102400", show_default=True, help="cached positions L")
@click.option("--tree-sizes", default="1,41,121", show_default=True, help="tokens T per verify pass")
@click.option("--gen-len", default=None, help="generation lengths modeled [20480,40960,61440,81920,102400]")
@click.option("--prefix-len", type=int, default=None, help="prompt length modeled [4096]")
@click.option(
    "--accept-length",
    type=float,
    default=PAPER_ACCEPT_LENGTH,
    show_default=True,
    help="τ, tokens per iteration of partial-cache drafting (tree 1,3,3,3: at most 5; 4α+1 with the "
    "paper's α 0.84)",
)
@click.option(
    "--verify-accept-length",
    type=float,
    default=None,
    help="τ when drafting from the verify pass (tree 3,3,3: at most 4) [--accept-length, at most 4]",
)
@click.option(
    "--acceptance-from",
    type=click.Path(path_type=Path),
    default=None,
    help="trained model dir whose measured τ replaces --accept-length (2,048 sampled tokens)",
)
@click.option(
    "--verify-tree-size", type=int, default=None, help="T of the modeled verify pass [largest --tree-sizes]"
)
@click.option(
    "--host-overhead-ms",
    type=float,
    default=None,
    help="host time per iteration (default: measured by a short generation, tree 1,3,3,3, k=20)",
)
@click.option("--step-repeats", type=int, default=20, show_default=True, help="timed runs per step (median)")
@click.option("--kv-budget", type=int, default=None, help="partial KV cache budget B [4096]")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default=None,
    help="default: the preset's on CUDA, float32 on a CPU",
)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--compile-steps", is_flag=True, help="fixed-shape steps through torch.compile (as generate's flag)"
)
@report_out_option("runs/steps")
@kernel_option
def bench_steps(
    model,
    contexts,
    tree_sizes,
    gen_len,
    prefix_len,
    accept_length,
    verify_accept_length,
    acceptance_from,
    verify_tree_size,
    host_overhead_ms,
    step_repeats,
    kv_budget,
    dtype,
    device,
    compile_steps,
    out,
    kernels,
) -> None:
    """The cost of one AR, draft and verify step per context against the memory-bandwidth floor, and
    the speedup those costs imply (docs/gpu.md)."""
    from tokenswift_trt.bench.step_bench import StepBenchJob, check_cuda, run_step_bench
    from tokenswift_trt.bench.steps import DEFAULT_GEN_LENGTHS, DEFAULT_PROMPT_LENGTH

    from ..progress import progress_bar

    try:
        check_cuda(device)
    except ValueError as error:
        raise fail(error) from None
    context_list, sizes = int_list(contexts, "--contexts"), int_list(tree_sizes, "--tree-sizes")
    job = StepBenchJob(
        model=model,
        contexts=context_list,
        tree_sizes=sizes,
        gen_lens=DEFAULT_GEN_LENGTHS if gen_len is None else int_list(gen_len, "--gen-len"),
        prompt_length=DEFAULT_PROMPT_LENGTH if prefix_len is None else prefix_len,
        accept_length=accept_length,
        verify_accept_length=verify_accept_length,
        acceptance_from=acceptance_from,
        verify_tree_size=verify_tree_size,
        host_overhead_ms=host_overhead_ms,
        step_repeats=step_repeats,
        kv_budget=kv_budget,
        dtype=dtype,
        device=device,
        compile_steps=compile_steps,
        kernels=kernels,
        out=out,
        command=given_command("tokenswift-trt bench-steps"),
    )
    bars = []  # opened at the first measured step, after the engine is built and the host timed

    def on_step(cost: StepCost) -> None:
        if not bars:
            total = len(context_list) * (3 + len(sizes))
            bars.append(progress_bar(total=total, desc="step costs", unit="step", leave=False))
        bars[0].set_postfix_str(f"L={cost.context} {cost.step}", refresh=False)
        bars[0].update(1)

    try:
        result = run_step_bench(job, on_step, note=lambda line: click.echo(line, err=True))
    except ValueError as error:
        raise fail(error) from None
    finally:
        for bar in bars:
            bar.close()
    _print_step_report(result, job)


def _print_step_report(result: StepBenchResult, job: StepBenchJob) -> None:
    """bench-steps' tables: step costs per context against their floor, then the modeled speedups."""
    from tokenswift_trt.bench.steps import PAPER_A100_LLAMA31_8B, verify_step

    meta = result.meta
    click.echo(
        f"{meta['model']} ({meta['dtype']}, random weights) on {meta['device']}; copy bandwidth "
        f"{result.bandwidth / 1e9:.1f} GB/s; attention {meta['attention_kernel']}, "
        f"fused elementwise {meta['fused_elementwise']}"
    )
    steps = ["ar", "draft", "heads"] + [verify_step(size) for size in job.tree_sizes]
    click.echo("context | " + " | ".join(f"{step} ms (floor)" for step in steps))
    by_key = {(cost.context, cost.step): cost for cost in result.costs}
    for context in sorted(job.contexts):
        cells = [by_key[context, step] for step in steps]
        click.echo(
            f"{context} | "
            + " | ".join(f"{c.seconds * 1e3:.3f} ({c.bandwidth_seconds * 1e3:.3f})" for c in cells)
        )
    click.echo(
        f"modeled: prompt {job.prompt_length}, T {result.tree_size}, τ partial {result.accept_length:.3f} / "
        f"verify {result.verify_accept_length:.3f}, host {result.host_overhead_ms:.3f} ms"
    )
    if result.extrapolated is not None:
        measured, needed = result.extrapolated
        click.echo(
            f"note: the model extrapolates step costs measured up to context {measured} to "
            f"{needed}: measure larger --contexts for figures to trust",
            err=True,
        )
    click.echo("gen_len | AR s | partial s | speedup partial | verify s | speedup verify | paper A100 8B")
    for gen_length in job.gen_lens:
        partial, verify = (
            next(s for s in result.speedups if s.gen_length == gen_length and s.mode == mode)
            for mode in ("partial", "verify")
        )
        click.echo(
            f"{gen_length} | {partial.ar_seconds:.1f} | {partial.tokenswift_seconds:.1f} | "
            f"{partial.speedup:.2f} | {verify.tokenswift_seconds:.1f} | {verify.speedup:.2f} | "
            f"{PAPER_A100_LLAMA31_8B.get(gen_length, '-')}"
        )
    click.echo("wrote " + ", ".join(str(p) for p in result.written))
