"""The GPU check's tensor-parallel stage: one generation on one device and on N ranks, compared.

    python -m tools.tp_check OUT.json [--device cuda] [--tp 2] [--model swift-tiny]

Runs `generate --json` greedy, then the same with `--tp N` (NCCL on N GPUs, gloo on a CPU), and
writes both runs' tokens per second and whether their tokens are equal. In bf16 on GPUs a near-tie
may sample differently (a row-parallel product rounds its partial sums apart); on a CPU in float32
they are equal (docs/deploy.md, "Tensor parallelism").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROMPT = "It is a truth universally acknowledged, that"


def generate(model: str, device: str, dtype: str, tokens: int, tp: int) -> dict:
    """One `generate --json` run's report (raises with its last error line on failure)."""
    command = [sys.executable, "-m", "tokenswift_trt", "generate", "--model", model, "--prompt", PROMPT]
    command += ["--max-new-tokens", str(tokens), "--temperature", "0", "--ignore-eos", "--json"]
    command += ["--device", device, "--dtype", dtype, "--tp", str(tp)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"--tp {tp}: {(result.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default="swift-tiny")
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    one, split = (generate(args.model, args.device, dtype, args.tokens, tp) for tp in (1, args.tp))
    record = {
        "model": args.model,
        "device": args.device,
        "dtype": dtype,
        "tp": args.tp,
        "tokens": args.tokens,
        "tokens_equal": one["token_ids"] == split["token_ids"],
        "first_difference": next(
            (i for i, (a, b) in enumerate(zip(one["token_ids"], split["token_ids"])) if a != b), None
        ),
        "tokens_per_s": {"tp1": one["tokens_per_s"], f"tp{args.tp}": split["tokens_per_s"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
