"""Modeled time of the Llama 3.1 8B draft-layer recipe (recipes/llama3.1-8b.sh) on one 8-GPU node, from
the step costs measured on an H200 (docs/bench/gpu-h200-8b-curve: the 8B shape's prefill and AR step).

    python -m tools.model_training --out docs/bench/modeled-8b-training

Inputs, all written to the artefact:
- data: `sequences` continuations of `new_tokens` tokens after `prompt_tokens`-token prompts, decoded
  one request per GPU at the measured AR step time at 4K context (batching decodes more at once, so
  this is an upper bound on the data's time; the recipe decodes with --max-batch 32);
- training: `steps` optimiser steps of `batch` x `grad_accum` sequences of `seq_len` tokens, each token
  one base forward at the measured prefill cost per token plus the draft layers' forward and backward
  (three hidden x hidden layers and the LM head's rows of the draft vocabulary, forward + 2 x backward,
  as a share of the base forward's FLOPs), over 8 GPUs;
- evaluation: `eval-heads` as the recipe runs it (prediction on held-out text plus generate runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

SOURCE = Path("docs/bench/gpu-h200-8b-curve/bench.json")
HIDDEN, LAYERS, PARAMS = 4096, 32, 8.03e9  # Llama 3.1 8B
DRAFT_LAYERS, DRAFT_VOCAB = 3, 16384


def measured(source: Path) -> dict[str, float]:
    """Per-token prefill seconds and the AR step at 4K context from the H200 curve."""
    document = json.loads(source.read_text())
    row = min(document["rows"], key=lambda r: r["prefix_len"])
    return {
        "context": row["prefix_len"],
        "prefill_s_per_token": row["prefill_s"] / row["prefix_len"],
        "ar_s_per_token": row["ar_ms_per_token"] / 1e3,
        "gpu": document["meta"].get("gpu", "?"),
        "date": document["meta"].get("date", "?"),
    }


def model(recipe: dict[str, int], costs: dict[str, float], gpus: int) -> dict[str, float]:
    """Hours per phase of the recipe on `gpus` GPUs."""
    data_tokens = recipe["sequences"] * recipe["new_tokens"]
    data_s = data_tokens * costs["ar_s_per_token"] / gpus
    # draft layers + their head, forward and backward (x3), relative to the base forward per token
    draft_params = DRAFT_LAYERS * (HIDDEN * HIDDEN + DRAFT_VOCAB * HIDDEN)
    draft_share = 3 * draft_params / PARAMS
    train_tokens = recipe["steps"] * recipe["batch"] * recipe["grad_accum"] * recipe["seq_len"]
    train_s = train_tokens * costs["prefill_s_per_token"] * (1 + draft_share) / gpus
    eval_s = (recipe["eval_tokens"] * costs["prefill_s_per_token"]) + 2 * recipe["measure_tokens"] * costs[
        "ar_s_per_token"
    ]
    return {
        "data_tokens": data_tokens,
        "data_hours": data_s / 3600,
        "train_tokens": train_tokens,
        "draft_share_of_base_forward": draft_share,
        "train_hours": train_s / 3600,
        "eval_hours": eval_s / 3600,
        "total_hours": (data_s + train_s + eval_s) / 3600,
    }


RECIPE = {  # recipes/llama3.1-8b.sh
    "sequences": 8192,
    "prompt_tokens": 128,
    "new_tokens": 2048,
    "steps": 6000,
    "batch": 4,
    "grad_accum": 4,
    "seq_len": 2048,
    "eval_tokens": 32 * 2048,
    "measure_tokens": 8 * 1024,
}


def markdown(document: dict) -> str:
    hours, costs = document["modeled"], document["measured"]
    return "\n".join(
        [
            "# Modeled: the Llama 3.1 8B draft-layer recipe on one 8-GPU node",
            "",
            f"Modeled, not run. Inputs: the 8B shape's step costs measured on an {costs['gpu']} "
            f"({costs['date']}, `{SOURCE}`): prefill {costs['prefill_s_per_token'] * 1e3:.3f} ms per token, "
            f"AR step {costs['ar_s_per_token'] * 1e3:.2f} ms at {costs['context']:,} tokens of context; the "
            "recipe's sizes below; 8 GPUs of that speed. Data decoding is taken one request per GPU (an "
            "upper bound: the recipe batches 32).",
            "",
            "| phase | tokens | hours |",
            "| --- | --- | --- |",
            f"| train-data | {hours['data_tokens']:,} | {hours['data_hours']:.2f} |",
            f"| train-heads | {hours['train_tokens']:,} | {hours['train_hours']:.2f} |",
            f"| eval-heads | | {hours['eval_hours']:.2f} |",
            f"| total | | {hours['total_hours']:.2f} |",
            "",
            f"Recipe: {json.dumps(document['recipe'])}.",
            f"Command: `{document['command']}`; {document['date']}.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="the measured H200 curve (bench.json)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    costs = measured(args.source)
    document = {
        "date": datetime.date.today().isoformat(),
        "gpu": costs["gpu"],
        "cpu": "not used (arithmetic over measured GPU costs)",
        "command": "python -m tools.model_training --out " + str(args.out),
        "label": "modeled",
        "gpus": args.gpus,
        "recipe": RECIPE,
        "measured": costs,
        "modeled": model(RECIPE, costs, args.gpus),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model.json").write_text(json.dumps(document, indent=2) + "\n")
    (args.out / "README.md").write_text(markdown(document))
    print(markdown(document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
