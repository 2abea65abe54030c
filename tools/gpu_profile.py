"""Where a GPU decode step's time goes: kernel tables of one fixed-shape step of an 8B-shaped
engine (random weights), and of a short swift-tiny generation (host operators included).

    python -m tools.gpu_profile [--contexts 4096,32768] [--tree-sizes 1,41] [--tiny-tokens 256]

Needs a CUDA GPU. Prints tables; used for docs/gpu.md ("Where the time goes").
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenswift_trt.bench.steps import filled_caches, random_engine
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.static_step import StaticForward
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig


def table(prof: profile, sort: str, rows: int = 14) -> str:
    for key in (sort, sort.replace("device", "cuda")):
        try:
            return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
        except (AttributeError, KeyError, ValueError):
            continue
    return prof.key_averages().table(row_limit=rows)


def replay_ms(call, repeats: int = 30) -> float:
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def profile_8b(contexts: list[int], tree_sizes: list[int]) -> None:
    engine, _ = random_engine("llama3.1-8b", device="cuda")
    model = engine.model
    for context in contexts:
        capacity = context + 128 + 1
        full, _ = filled_caches(engine, context, capacity, 64)
        for size in tree_sizes:
            tokens = torch.randint(engine.config.vocab_size, (size,), device="cuda")
            positions = torch.arange(context, context + size, device="cuda")
            mask = torch.ones(size, size, dtype=torch.bool).tril() if size > 1 else None
            with torch.inference_mode():
                graphed = StaticForward(model, full, capture=True)
                eager = StaticForward(model, full, capture=False)

                def step(runner=graphed, tokens=tokens, positions=positions, mask=mask, cache=full) -> None:
                    model.logits(runner.run(tokens, positions, mask).hidden[-1:])
                    cache.rollback(0)

                graph_ms = replay_ms(step)
                eager_ms = replay_ms(lambda eager=eager: step(eager))
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step(eager)
                    torch.cuda.synchronize()
            print(
                f"\n### 8B L={context} T={size}: graph {graph_ms:.3f} ms/step, eager {eager_ms:.3f} ms/step "
                "(kernel table from 5 eager steps)"
            )
            print(table(prof, "self_device_time_total"))
        del full
        torch.cuda.empty_cache()


def profile_tiny(tokens: int) -> None:
    engine = load_engine("models/swift-tiny", device="cuda", dtype=torch.bfloat16)
    prompt = TextCodec.from_dir("models/swift-tiny").encode(open("models/swift-tiny/prompt.txt").read())
    sampling = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=256)
    for method, tree in (("ar", "1"), ("tokenswift", "1,3,3,3")):
        config = GenerationConfig(
            max_new_tokens=tokens,
            sampling=sampling,
            tree=tree,
            ngram_topk=20,
            kv_budget=1024,
            seed=1,
            ignore_eos=True,
            method=method,
        )
        generate(engine, prompt, config)  # warm-up: graph captures
        torch.cuda.synchronize()
        start = time.perf_counter()
        _, stats = generate(engine, prompt, config)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(
            f"\n### swift-tiny {method} {tree}: {stats.new_tokens} tokens in {seconds:.2f}s "
            f"({stats.new_tokens / seconds:.0f} tok/s), {stats.iterations} iterations, "
            f"{seconds / stats.iterations * 1e3:.2f} ms/iteration, graph replays {stats.graph_replays}, "
            f"captures {stats.graph_captures}, fixed-shape steps {stats.fixed_shape_steps}"
        )
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(engine, prompt, config)
            torch.cuda.synchronize()
        print(table(prof, "self_cpu_time_total", 25))


def list_syncs(tokens: int) -> None:
    """Every place a swift-tiny TokenSwift generation waits for the GPU (torch's sync debug mode)."""
    import collections
    import traceback
    import warnings

    engine = load_engine("models/swift-tiny", device="cuda", dtype=torch.bfloat16)
    prompt = TextCodec.from_dir("models/swift-tiny").encode(open("models/swift-tiny/prompt.txt").read())
    config = GenerationConfig(
        max_new_tokens=tokens,
        sampling=SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=256),
        tree="1,3,3,3",
        ngram_topk=20,
        kv_budget=1024,
        seed=1,
        ignore_eos=True,
    )
    generate(engine, prompt, config)  # captures first
    sites: collections.Counter[str] = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if "tokenswift_trt" in f.filename
            or any(f"/{p}/" in f.filename for p in ("decode", "model", "backends", "kernels"))
        ]
        sites[
            " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[-2:][::-1])
        ] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            _, stats = generate(engine, prompt, config)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = original
    print(f"\n### host synchronisations in {stats.iterations} iterations (per iteration, by site)")
    for site, count in sites.most_common(30):
        print(f"{count / stats.iterations:6.2f}  {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--tree-sizes", default="1,41")
    parser.add_argument("--tiny-tokens", type=int, default=256)
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument(
        "--syncs-only", action="store_true", help="only list where the generation waits for the GPU"
    )
    args = parser.parse_args()
    if args.syncs_only:
        list_syncs(args.tiny_tokens)
        return
    profile_tiny(args.tiny_tokens)
    if not args.skip_8b:
        profile_8b([int(c) for c in args.contexts.split(",")], [int(t) for t in args.tree_sizes.split(",")])


if __name__ == "__main__":
    main()
