"""Our AR baseline against transformers' own greedy `generate` on the same model and prompt.

Every speedup is quoted over our AR, so our AR must be at least as fast as the reference
implementation users would otherwise run. Runs alternate (ours, theirs, theirs, ours, ...) so
that a machine whose speed drifts charges both alike; each run is timed whole, prefill included,
and both must produce the same greedy tokens.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import SamplingConfig

from .report import machine_meta, write_csv


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
