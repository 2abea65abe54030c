"""Fixed trees against AR steps, for one or more heads files, taking turns in one process.

    .venv/bin/python experiments/tree_ab.py [--model smollm2-135m] [--heads NAME=FILE ...] \
        [--trees "3;2,1;3,1"] [--tokens 768] [--seed 1] [--rounds 3] [--prefix-len 512]

Continues the opening `--prefix-len` tokens of the held-out Pride and Prejudice under the preset's
sampling settings (SmolLM2's: the paper's min-p 0.1, θ 1.2, W 256; `--temperature 0` for greedy)
with AR steps and with every (heads file, tree) pair, drafting from the verify pass, no n-gram
branch. Each round runs every configuration once, the order reversed every other round, and checks
that every output equals AR's token for token. Prints per configuration: seconds per run (prefill
excluded), speedup over AR, tokens per iteration, ms per iteration and its split by stage
(`Stats.phase_s`), and for `auto` the plans the tuner ran. Without `--heads` the preset's committed
draft layers run alone. `--full-head-too` adds every configuration again with the float16-screened LM
head switched off (`TOKENSWIFT_SCREENED_HEAD=0`, model/screened_head.py), labelled "... full head".
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace
from pathlib import Path

from tokenswift_trt.cli.common import CliError, generation_config, load_source
from tokenswift_trt.decode.autotune import describe_plans
from tokenswift_trt.decode.loop import Stats, generate

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT.parent / "shared" / "corpus" / "pride_and_prejudice.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--heads", action="append", default=[], help="NAME=FILE (repeatable)")
    parser.add_argument("--trees", default="3;2,1")
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--prompt-file", type=Path, default=HELD_OUT)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--full-head-too", action="store_true", help="also run each with the full LM head")
    args = parser.parse_args()
    if not args.prompt_file.is_file():
        raise SystemExit(f"prompt file {args.prompt_file} not found: pass --prompt-file")
    heads: dict[str, Path | None] = {"committed": None}
    if args.heads:
        heads = {}
        for item in args.heads:
            name, _, path = item.partition("=")
            if not path or not Path(path).is_file():
                raise SystemExit(f"--heads takes NAME=FILE with an existing file, got {item!r}")
            heads[name] = Path(path)
    try:
        engines = {
            name: load_source(args.model, None, None, path, None, "cpu", True) for name, path in heads.items()
        }
    except CliError as error:
        raise SystemExit(str(error)) from None
    first = next(iter(engines.values()))
    prompt = first.codec.encode(args.prompt_file.read_text()[:200_000])[: args.prefix_len]
    settings = {
        "seed": args.seed,
        "temperature": args.temperature,
        "ignore_eos": True,
        "ngram_topk": 0,
        "draft_source": "verify",
    }
    try:  # the preset's sampling settings, as `generate` and `bench` take them
        base = generation_config(args.tokens, "tokenswift", settings, first.defaults)
    except CliError as error:
        raise SystemExit(str(error)) from None
    configs = {"ar": (first, replace(base, method="ar"))}
    for tree in args.trees.split(";"):
        for name, source in engines.items():
            label = f"{name} {tree}" if len(engines) > 1 else tree
            configs[label] = (source, replace(base, tree=tree))
    if args.full_head_too:
        configs.update({f"{label} full head": config for label, config in list(configs.items())})
    results: dict[str, list[Stats]] = {}
    reference = None
    for round_index in range(args.rounds):
        order = list(configs) if round_index % 2 == 0 else list(configs)[::-1]
        for label in order:
            source, config = configs[label]
            if args.full_head_too:  # otherwise the caller's environment decides
                os.environ["TOKENSWIFT_SCREENED_HEAD"] = "0" if label.endswith(" full head") else "1"
            tokens, stats = generate(source.engine, prompt, config)
            if reference is None:
                reference = tokens
            if tokens != reference:
                raise SystemExit(f"{label}: the tokens differ from AR's")
            results.setdefault(label, []).append(stats)
    ar_s = statistics.mean(s.elapsed_s - s.prefill_s for s in results["ar"])
    print("| plan | s per run | speedup | tokens / iteration | ms / iteration | stages (ms / iteration) |")
    print("|---|---|---|---|---|---|")
    for label, runs in results.items():
        seconds = statistics.mean(s.elapsed_s - s.prefill_s for s in runs)
        iterations = sum(s.iterations for s in runs)
        phases: dict[str, float] = {}
        for stats in runs:
            for phase, value in stats.phase_s.items():
                phases[phase] = phases.get(phase, 0.0) + value
        split = ", ".join(f"{phase} {value / iterations * 1e3:.2f}" for phase, value in phases.items())
        per_iteration = sum(s.new_tokens for s in runs) / iterations
        print(
            f"| {label} | {seconds:.2f} | {ar_s / seconds:.3f} | {per_iteration:.3f} | "
            f"{seconds * len(runs) / iterations * 1e3:.2f} | {split} |"
        )
    for label, runs in results.items():  # `--tree auto`: what the tuner ran, per run
        for index, stats in enumerate(runs):
            if stats.plans:
                print(f"{label} run {index + 1}: " + " | ".join(describe_plans(stats.plans)))


if __name__ == "__main__":
    main()
