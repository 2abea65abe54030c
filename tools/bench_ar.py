"""Our AR baseline against transformers' own greedy `generate` on the same model and prompt
(float32, CPU): bench_ar.csv and bench_ar.json.

Every speedup is quoted over our AR, so our AR must be at least as fast as the reference
implementation users would otherwise run. Runs alternate (ours, theirs, theirs, ours, ...) so
that a machine whose speed drifts charges both alike; each run is timed whole, prefill included,
and both must produce the same greedy tokens. docs/benchmarks.md quotes its figures.

    .venv/bin/python -m tools.bench_ar --model smollm2-135m --prompt-file models/swift-tiny/prompt.txt \
        --out runs/bench-ar
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.api import ApiError, load
from tokenswift_trt.bench.report import machine_meta, write_csv
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import SamplingConfig


class ReferenceError(RuntimeError):
    """transformers cannot run the comparison here (the message says what to install)."""


@dataclass
class ReferenceComparison:
    new_tokens: int
    ours_tokens_per_s: list[float]  # one per repeat
    reference_tokens_per_s: list[float]
    same_tokens: bool

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours_tokens_per_s)

    @property
    def reference_median(self) -> float:
        return statistics.median(self.reference_tokens_per_s)

    @property
    def ratio(self) -> float:
        """Median of ours / theirs over the repeats (> 1: our AR is faster)."""
        pairs = zip(self.ours_tokens_per_s, self.reference_tokens_per_s)
        return statistics.median(ours / theirs for ours, theirs in pairs)


def load_reference(
    model_dir: Path, dtype: torch.dtype = torch.float32
) -> Callable[[Sequence[int], int], list[int]]:
    """transformers' model for `model_dir` as a function (prompt ids, new tokens) -> greedy ids."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ReferenceError("the comparison needs transformers: pip install 'transformers>=5,<6'") from None
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()

    def run(prompt: Sequence[int], new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([list(prompt)]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    return run


def compare_with_reference(
    engine: Engine,
    reference: Callable[[Sequence[int], int], list[int]],
    prompt: Sequence[int],
    new_tokens: int,
    repeats: int = 2,
) -> ReferenceComparison:
    """Greedy AR of ours and the reference's `generate`, alternating, `repeats` runs each."""
    config = GenerationConfig(
        max_new_tokens=new_tokens, method="ar", sampling=SamplingConfig(temperature=0), ignore_eos=True
    )
    ours_rates, theirs_rates, same = [], [], True
    for repeat in range(repeats):
        order = ("ours", "theirs") if repeat % 2 == 0 else ("theirs", "ours")
        outputs: dict[str, list[int]] = {}
        for who in order:
            started = time.perf_counter()
            if who == "ours":
                outputs[who], _ = generate(engine, prompt, config)
            else:
                outputs[who] = reference(prompt, new_tokens)
            rate = new_tokens / (time.perf_counter() - started)
            (ours_rates if who == "ours" else theirs_rates).append(rate)
        same = same and outputs["ours"] == outputs["theirs"]
    return ReferenceComparison(new_tokens, ours_rates, theirs_rates, same)


def write_reference_report(
    result: ReferenceComparison, model: str, prefix_len: int, repeats: int, out: Path, command: str
) -> dict[str, Any]:
    """bench_ar.csv (one row: the medians and their ratio) and bench_ar.json (the row, every repeat's
    rates, the command and the machine) under `out`; returns the row."""
    row = {
        "model": model,
        "prefix_len": prefix_len,
        "gen_len": result.new_tokens,
        "repeats": repeats,
        "ours_tokens_per_s": round(result.ours_median, 2),
        "transformers_tokens_per_s": round(result.reference_median, 2),
        "ours_over_transformers": round(result.ratio, 3),
        "same_tokens": result.same_tokens,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_ar.csv", [row])
    report = {
        "meta": {"command": command, **machine_meta()},
        "row": row,
        "ours": result.ours_tokens_per_s,
        "transformers": result.reference_tokens_per_s,
    }
    (out / "bench_ar.json").write_text(json.dumps(report, indent=2) + "\n")
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a preset (tokenswift-trt models lists them)")
    source.add_argument("--model-dir", type=Path, help="a Hugging Face model directory")
    parser.add_argument("--prompt-file", type=Path, required=True, help="text the prompt is cut from")
    parser.add_argument("--prefix-len", type=int, default=128, help="prompt tokens (128)")
    parser.add_argument("--gen-len", type=int, default=512, help="new tokens per run (512)")
    parser.add_argument("--repeats", type=int, default=2, help="runs each, alternating who goes first (2)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-ar"))
    args = parser.parse_args(argv)
    if args.prefix_len < 1 or args.gen_len < 1 or args.repeats < 1:
        parser.error("--prefix-len, --gen-len and --repeats must be at least 1")
    try:
        text = args.prompt_file.read_text()
        model = load(args.model, model_dir=args.model_dir, dtype="float32", device="cpu")
        model_dir = model.origin.model_dir
        assert model_dir is not None
        reference = load_reference(model_dir)
    except (ApiError, ReferenceError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    prompt = model.codec.encode(text)[: args.prefix_len]
    result = compare_with_reference(model.engine, reference, prompt, args.gen_len, args.repeats)
    command = shlex.join(["python", "-m", "tools.bench_ar", *(sys.argv[1:] if argv is None else argv)])
    row = write_reference_report(result, str(model_dir), len(prompt), args.repeats, args.out, command)
    print(" | ".join(row))
    print(" | ".join(str(value) for value in row.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
