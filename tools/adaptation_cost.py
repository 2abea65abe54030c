"""What one online adaptation step of the draft layers costs on this machine (model/draft_adaptation.py).

For each variant (optimiser, scope, block size) the step is timed on real committed positions: a
prompt's hidden states from the target, fed to a request's `DraftAdapter` a block at a time, as the
decoding loop feeds it. Reported per variant: milliseconds per step (the median), of them the
re-packing of the changed products for the CPU kernels, and milliseconds per committed token
(step / block). Also the draft pass of one row with the layers packed and unpacked (what skipping
the re-pack would cost every iteration instead).

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.adaptation_cost --model-dir models/smollm2-135m \
        --prompt-file data/corpus/pride_and_prejudice.txt --out docs/bench/adapt-cost-smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch

from tokenswift_trt.bench.report import machine_meta
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.state import new_adapter, new_decode_state
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import PositionKeyedRandom, SamplingConfig

VARIANTS = [  # (optimizer, scope, block)
    ("adam", "all", 16),
    ("sgd", "all", 16),
    ("adam", "layer1", 16),
    ("sgd", "layer1", 16),
    ("adam", "all", 64),
    ("sgd", "layer1", 64),
]
PAPER = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--positions", type=int, default=768, help="committed positions fed per variant")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    engine = load_engine(args.model_dir)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    tokens = tokenizer.encode(args.prompt_file.read_text()[:20000]).ids[: args.positions + 1]
    rows = []
    for optimizer, scope, block in VARIANTS:
        config = GenerationConfig(
            max_new_tokens=8,
            sampling=PAPER,
            adapt_drafts=True,
            adapt_block=block,
            adapt_scope=scope,
            adapt_optimizer=optimizer,
        )
        state = new_decode_state(engine, tokens, config, PositionKeyedRandom(0))
        with torch.inference_mode():
            hidden = engine.model(
                torch.tensor(tokens), torch.arange(len(tokens)), state.full, keep_queries=False
            ).hidden  # [T, hidden]
        adapter = new_adapter(engine, state, config)
        steps, repacks = [], []
        with torch.inference_mode():
            for start in range(0, args.positions - block + 1, block):
                began = time.perf_counter()
                adapter.observe(start, hidden[start : start + block], tokens[start + 1 : start + 1 + block])
                steps.append(time.perf_counter() - began)
                began = time.perf_counter()
                for linear in adapter.repacked:
                    linear.pack(half=True, kernels=adapter.kernels)
                repacks.append(time.perf_counter() - began)
        steps, repacks = steps[2:], repacks[2:]  # the first steps allocate the optimiser's state
        step_ms = 1e3 * statistics.median(steps)
        rows.append(
            {
                "optimizer": optimizer,
                "scope": scope,
                "block": block,
                "steps": len(steps),
                "step_ms": round(step_ms, 2),
                "repack_ms": round(1e3 * statistics.median(repacks), 2),
                "ms_per_committed_token": round(step_ms / block, 3),
                "parameters": sum(
                    p.numel() for group in adapter.optimizer.param_groups for p in group["params"]
                ),
            }
        )
        print(rows[-1], flush=True)
    draft = {}
    with torch.inference_mode():
        root = torch.tensor(tokens[-1:])
        for packed in (True, False):
            layers = adapter.layers
            if not packed:
                for linear in adapter.repacked:
                    linear._packed = None
            times = []
            for _ in range(50):
                began = time.perf_counter()
                engine.model.draft_logits(hidden[-1:], layers, 3, root)
                times.append(time.perf_counter() - began)
            draft["packed" if packed else "unpacked"] = round(1e3 * statistics.median(times[5:]), 3)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python -m tools.adaptation_cost " + " ".join(f"{k}={v}" for k, v in vars(args).items()),
        "threads": torch.get_num_threads(),
        "load_average_1_5_15_min": [round(load, 2) for load in os.getloadavg()],  # the machine is shared
        "sampling": vars(PAPER),
        **machine_meta(),
    }
    report = {"meta": meta, "steps": rows, "draft_pass_ms_3_layers": draft}
    (args.out / "cost.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(draft))


if __name__ == "__main__":
    main()
