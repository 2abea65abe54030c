"""The host loop against the device loop on this machine: tokens/s of each executor and of AR steps.

Both executors run the same stages (decode/stages.py) and commit the same tokens, iteration by
iteration; this measures which is faster here, for a static plan and for `--tree auto`. AR, the host
loop and the device loop decode the same prompt in turns of `--interleave` new tokens, each timed on
its own clock (bench.run.take_turns), `--repeats` times. Writes executors.json (per plan: tokens/s of
each executor and AR, the ratios, iterations, whether the tokens agreed) under --out.

    .venv/bin/python -m tools.executors_compare --model-dir models/swift-tiny \
        --prompt-file data/corpus/pride_and_prejudice.txt --out docs/bench/cpu-executors-swift-tiny
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings
from dataclasses import replace
from datetime import date
from pathlib import Path

from tokenswift_trt.bench.report import machine_meta
from tokenswift_trt.bench.run import take_turns
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import decode_steps
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig

PAPER = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=256)
PLANS = "3,2,1:4;3,3,3:20;auto:20"  # tree:k, separated by semicolons


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--interleave", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--plans", default=PLANS, help=f"tree:k;tree:k ... [{PLANS}]")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    plans = [(tree, int(topk)) for tree, topk in (part.split(":") for part in args.plans.split(";"))]
    warnings.simplefilter("ignore")
    engine = load_engine(args.model_dir)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    prompt = tokenizer.encode(args.prompt_file.read_text()[:20000]).ids[: args.prompt_tokens]
    base = GenerationConfig(
        max_new_tokens=args.new_tokens, sampling=PAPER, seed=1, ignore_eos=True, draft_source="verify"
    )
    rows = []
    for tree, topk in plans:
        config = replace(base, tree=tree, ngram_topk=topk)
        configs = {
            "ar": replace(base, method="ar"),
            "host": replace(config, device_loop=False),
            "device": replace(config, device_loop=True),
        }
        seconds = dict.fromkeys(configs, 0.0)
        iterations, agreed = dict.fromkeys(configs, 0), True
        for _ in range(args.repeats):
            steps = {name: decode_steps(engine, prompt, c) for name, c in configs.items()}
            results = take_turns(steps, args.interleave)
            agreed &= results["host"][0] == results["device"][0] == results["ar"][0]
            for name, (_, stats, clock) in results.items():
                seconds[name] += clock
                iterations[name] += stats.iterations
        tokens_per_s = {name: args.new_tokens * args.repeats / s for name, s in seconds.items()}
        rows.append(
            {
                "tree": tree,
                "ngram_topk": topk,
                "tokens_per_s": {name: round(value, 1) for name, value in tokens_per_s.items()},
                "host_vs_ar": round(tokens_per_s["host"] / tokens_per_s["ar"], 3),
                "device_vs_ar": round(tokens_per_s["device"] / tokens_per_s["ar"], 3),
                "device_vs_host": round(tokens_per_s["device"] / tokens_per_s["host"], 3),
                "iterations": iterations,
                "same_tokens": agreed,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python -m tools.executors_compare " + shlex.join(sys.argv[1:]),
        "date": date.today().isoformat(),
        "load_average": os.getloadavg(),
        **machine_meta(),
    }
    (args.out / "executors.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
