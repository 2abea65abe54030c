"""Each draft layer's chance that its first draft is the target's sample, on held-out book text.

    .venv/bin/python experiments/held_out_acceptance.py [--model smollm2-135m] [--heads FILE ...] \
        [--sequences 12] [--seq-len 512]

For every heads file (default: the preset's), the mean over `--sequences` evenly spaced stretches of
the held-out Pride and Prejudice of `training.train_heads.coupled_acceptance`: under the paper's
sampling settings (min-p 0.1, θ 1.2 over the last 256 tokens), the probability that layer i's
first candidate for x[t + 1 + i], ranked with the same Gumbel noise as the target's sample, is that
sample (in closed form, no noise drawn), i.e. what coupled verification accepts at depth i of a
one-candidate chain given the path before it. `train-heads` reports the same figure on its
evaluation text (`draft_coupled_acceptance` in train_heads.json). Also prints the layers' agreement
with the base model's top-1 (what greedy verification accepts).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tokenswift_trt.cli.common import load_source
from tokenswift_trt.model.sampling import SamplingConfig
from tokenswift_trt.training.train_heads import draft_accuracy, evaluation_sequences

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT.parent / "shared" / "corpus" / "pride_and_prejudice.txt"
PAPER_SAMPLING = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--heads", type=Path, action="append", default=None, help="heads file (repeatable)")
    parser.add_argument("--sequences", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--text", type=Path, default=HELD_OUT)
    args = parser.parse_args()
    if not args.text.is_file():
        raise SystemExit(f"held-out text {args.text} not found: pass --text FILE")
    for heads in args.heads or [None]:
        source = load_source(args.model, None, None, heads, None, "cpu", True)
        ids = torch.tensor(source.codec.encode(args.text.read_text()))
        sequences = evaluation_sequences(ids, args.seq_len, args.sequences)
        engine = source.engine
        accuracy = draft_accuracy(engine, engine.draft_layers, sequences, PAPER_SAMPLING)
        name = "preset's layers" if heads is None else str(heads)
        print(
            f"{name}: first draft is the sample "
            + " / ".join(f"{a:.4f}" for a in accuracy.acceptance)
            + "; agreement with the base's top-1 "
            + " / ".join(f"{a:.3f}" for a in accuracy.agreement)
            + f" (layers 1-{len(accuracy.acceptance)}, {args.sequences} x {args.seq_len} positions)"
        )


if __name__ == "__main__":
    main()
