"""Sampling noise as keys (computed in the CPU sampler for the tokens min-p keeps) against whole rows
(computed in tensor operations), side by side in one process: the same generation, both ways, taking
turns; tokens must be equal.

    .venv/bin/python experiments/noise_keys_ab.py [--model smollm2-135m] [--tokens 384] [--rounds 3] \
        [--method ar|tokenswift] [--tree 1]

Prints the sampling step alone (one row of the model's vocabulary, a fresh position each call, as
decoding asks: noise rows hashed, or keys), then milliseconds per generated token of every round for
each way (paper sampling: min-p 0.1, θ 1.2, W 256; the held-out Pride and Prejudice prompt, 512
tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tokenswift_trt.builder.presets import PRESETS, local_model_dir
from tokenswift_trt.decode.loop import GenerationConfig, generate
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import FusedSampler, PositionKeyedRandom, SamplingConfig, fused_sampler

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT.parent / "shared" / "corpus" / "pride_and_prejudice.txt"


def step_alone(vocab: int, sampling: SamplingConfig, calls: int = 300) -> None:
    """Microseconds per sampled position: noise rows (PositionKeyedRandom, with its look-ahead and
    memo) against keys, the same logits and window, taking turns in blocks of 30 calls."""
    sampler = fused_sampler(sampling, torch.device("cpu"), torch.float32)
    if sampler is None or not sampler.takes_keys:
        raise SystemExit("the compiled CPU sampler is not available here (TOKENSWIFT_CPU_KERNEL=0?)")
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 4
    window = torch.randint(0, vocab, (sampling.penalty_window,), generator=torch.Generator().manual_seed(1))
    random = PositionKeyedRandom(1)
    times: dict[str, list[float]] = {"rows": [], "keys": []}
    for block in range(0, calls, 30):
        for way, values in times.items():
            start = time.perf_counter()
            for position in range(block, block + 30):
                offset = position + (0 if way == "rows" else 1_000_000)  # fresh positions for each way
                if way == "rows":
                    noise = random.gumbel_rows([offset], vocab, torch.device("cpu"))
                else:
                    noise = random.keys([offset])
                sampler.samples(logits, window, noise)
            values.append((time.perf_counter() - start) / 30 * 1e6)
    print(" | ".join(f"{way}: {statistics.median(v):.0f} µs per position" for way, v in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--method", default="ar", choices=("ar", "tokenswift"))
    parser.add_argument("--tree", default="1")
    args = parser.parse_args()
    model_dir, heads = local_model_dir(PRESETS[args.model])
    engine = load_engine(model_dir, heads)
    prompt = TextCodec.from_dir(model_dir).encode(HELD_OUT.read_text()[:20000])[:512]
    tree = dict(tree=args.tree, draft_source="verify", ngram_topk=0) if args.method == "tokenswift" else {}
    config = GenerationConfig(
        max_new_tokens=args.tokens,
        sampling=SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=256),
        seed=1,
        ignore_eos=True,
        method=args.method,
        **tree,
    )
    step_alone(engine.config.vocab_size, config.sampling)
    real = FusedSampler.takes_keys
    times: dict[str, list[float]] = {"rows": [], "keys": []}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for way in times:
            FusedSampler.takes_keys = real if way == "keys" else property(lambda self: False)  # type: ignore[method-assign]
            output, stats = generate(engine, prompt, config)
            tokens.setdefault(way, output)
            times[way].append((stats.elapsed_s - stats.prefill_s) / stats.new_tokens * 1e3)
    FusedSampler.takes_keys = real  # type: ignore[method-assign]
    print("same tokens:", tokens["rows"] == tokens["keys"])
    for way, values in times.items():
        print(f"{way}: " + " / ".join(f"{v:.2f}" for v in values) + " ms per token")


if __name__ == "__main__":
    main()
