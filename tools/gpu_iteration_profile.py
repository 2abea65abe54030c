"""Where one device-loop iteration's time goes, phase by phase, at a few prompt lengths.

    python3 -m tools.gpu_iteration_profile [--model llama3.1-8b] [--contexts 4096,98304]
        [--tree 3,3,3] [--ngram-topk 20] [--iterations 16] [--kernels 25] [--out DIR]

One random-weights engine (the bench's `--random-weights` shape); per context a random prompt of that
length is prefilled and a `DeviceLoop` set up as `bench --device-loop` runs it. Reported per context:
the loop's setup (the n-gram table from the prompt, the first draft logits), the captured
iteration's replay time (CUDA events, ms per iteration: what `bench` measures, without the host's
reads), and eager iterations under the profiler, whose `device_loop.<phase>` labels give each
phase's device time per iteration (propose, trie, verify, heads, accept, commit, of which drafts and
n-grams). On a CPU it runs too, eagerly, with CPU times (a check of the mechanics, e.g. --model
swift-tiny).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tokenswift_trt.bench.steps import StepBenchError, random_engine
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.device_loop import DeviceLoop
from tokenswift_trt.decode.stages import prefill_alone, sample_next
from tokenswift_trt.decode.state import new_decode_state
from tokenswift_trt.decode.tree import build_static_tree
from tokenswift_trt.kernels.config import KernelConfig, parse_kernel_settings
from tokenswift_trt.model.sampling import PositionKeyedRandom, SamplingConfig

PHASES = ("propose", "trie", "verify", "heads", "accept", "commit", "drafts", "ngrams")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def phase_times(prof: profile, iterations: int, on_device: bool) -> dict[str, float]:
    """ms per iteration of each `device_loop.<phase>` label: device time on a GPU (from its timeline,
    `device_phase_times`), else CPU time."""
    if on_device:
        return device_phase_times(prof.events(), iterations)
    totals = dict.fromkeys(PHASES, 0.0)
    for event in prof.key_averages():
        name = event.key.removeprefix("device_loop.")
        if event.key.startswith("device_loop.") and name in totals:
            totals[name] += event.cpu_time_total / 1e3 / iterations
    return totals


def device_phase_times(events, iterations: int) -> dict[str, float]:
    """ms per iteration of device work (kernels, copies) that starts inside each `device_loop.<phase>`
    span of the GPU timeline. A label's host range would miss the Triton kernels (the profiler ties
    their launches to no host op: on an H200 a 98K-context verify's Triton kernels were 6 of its
    ~26 ms); its span on the GPU holds them. Nested phases (drafts and n-grams inside commit) count
    in both."""
    spans, work = [], []  # (start, end, phase); (start, duration), in µs
    for event in events:
        if getattr(event, "device_type", DeviceType.CPU) == DeviceType.CPU:
            continue
        start, end = event.time_range.start, event.time_range.end
        if event.key.startswith("device_loop."):
            spans.append((start, end, event.key.removeprefix("device_loop.")))
        elif not getattr(event, "is_user_annotation", False):
            work.append((start, end - start))
    work.sort()
    starts = [start for start, _ in work]
    sums = list(itertools.accumulate((duration for _, duration in work), initial=0.0))
    totals = dict.fromkeys(PHASES, 0.0)
    for start, end, name in spans:
        if name in totals:
            first, stop = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
            totals[name] += (sums[stop] - sums[first]) / 1e3 / iterations
    return totals


def measure(engine, context: int, args: argparse.Namespace) -> dict[str, object]:
    device = engine.device
    generator = torch.Generator().manual_seed(context)
    prompt = torch.randint(3, engine.config.vocab_size, (context,), generator=generator).tolist()
    config = GenerationConfig(
        max_new_tokens=16 * (args.iterations + 8),  # every iteration below runs; none may hit the limit
        tree=args.tree,
        ngram_topk=args.ngram_topk,
        draft_source="verify",
        device_loop=True,
        seed=1,
        ignore_eos=True,
        sampling=SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=1024),
    )
    state = new_decode_state(engine, prompt, config, PositionKeyedRandom(1))
    started = time.perf_counter()
    hidden = prefill_alone(engine, state, prompt, config.prefill_chunk)
    state.append([sample_next(engine, state, hidden)])
    synchronize(device)
    prefill_s = time.perf_counter() - started
    tree = build_static_tree(args.tree)
    started = time.perf_counter()
    eager = DeviceLoop(engine, state, tree.depth, args.ngram_topk, capture=False)
    eager.enter(hidden)
    eager_plan = eager.plan(tree, args.ngram_topk)
    synchronize(device)
    setup_s = time.perf_counter() - started
    route = eager.route(eager_plan)  # the verify's attention route for this context, as the loop chooses it
    for _ in range(2):
        eager.step(eager_plan, route)
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.iterations):
            eager.step(eager_plan, route)
        synchronize(device)
    eager_ms = (time.perf_counter() - started) * 1e3 / args.iterations
    phases = phase_times(prof, args.iterations, device.type == "cuda")
    if args.kernels > 0:  # the operators and kernels that take the most time, to stderr beside the table
        sort = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        try:
            top = prof.key_averages().table(sort_by=sort, row_limit=args.kernels, max_name_column_width=70)
        except (KeyError, ValueError, AttributeError):  # an older profiler's column names
            top = prof.key_averages().table(row_limit=args.kernels)
        print(f"context {context}, {args.iterations} eager iterations:\n{top}", file=sys.stderr, flush=True)
    replay_ms = None
    if device.type == "cuda":
        captured = DeviceLoop(engine, state, tree.depth, args.ngram_topk, capture=True)
        captured.enter(hidden)
        captured_plan = captured.plan(tree, args.ngram_topk)
        captured.launch(captured_plan)  # captures, then replays once
        synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iterations):
            captured.launch(captured_plan)
        end.record()
        synchronize(device)
        replay_ms = start.elapsed_time(end) / args.iterations
    return {
        "context": context,
        "slots": eager_plan.slots.size,
        "prefill_s": round(prefill_s, 3),
        "setup_s": round(setup_s, 4),
        "replay_ms": None if replay_ms is None else round(replay_ms, 3),
        "eager_ms": round(eager_ms, 3),
        "phases_ms": {name: round(value, 3) for name, value in phases.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.1-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", default="4096,98304")
    parser.add_argument("--tree", default="3,3,3")
    parser.add_argument("--ngram-topk", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument(
        "--kernels", type=int, default=25, help="rows of the profiler's table per context (0: none)"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--kernel", action="append", default=[], metavar="NAME=VALUE", help="a kernel setting (repeatable)"
    )
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    try:
        settings = KernelConfig().updated(parse_kernel_settings(args.kernel))
        engine, _ = random_engine(args.model, dtype, device, kernels=settings)
    except (StepBenchError, ValueError, RuntimeError) as error:
        raise SystemExit(str(error).splitlines()[0]) from None
    model = engine.model.torch_model
    print(
        f"{args.model} ({args.dtype}) on {device}; attention {model.attention_summary()}, fused elementwise "
        f"{model.fused_elementwise}; tree {args.tree} + {args.ngram_topk} n-gram branches"
    )
    unit = "device" if device.type == "cuda" else "CPU"
    print("| context | slots | setup s | replay ms | eager ms | " + " | ".join(PHASES) + f" ({unit} ms) |")
    print("|---" * (5 + len(PHASES)) + "|")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        with torch.inference_mode():  # as generation runs
            row = measure(engine, context, args)
        rows.append(row)
        phases = row["phases_ms"]
        replay = "-" if row["replay_ms"] is None else f"{row['replay_ms']:.2f}"
        print(
            f"| {context} | {row['slots']} | {row['setup_s']:.3f} | {replay} | {row['eager_ms']:.2f} | "
            + " | ".join(f"{phases[name]:.2f}" for name in PHASES)
            + " |",
            flush=True,
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"command": " ".join(sys.argv), "device": str(device), "torch": torch.__version__}
        report["rows"] = rows
        (args.out / "iteration.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
