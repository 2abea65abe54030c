"""Acceptance with drafts ranked by the target's noise vs by probability, on the same tokens.

    python experiments/coupled_drafting.py [--model-dir models/swift-tiny] [--tokens 4096]

Both runs sample with the same position-keyed noise, so they emit identical tokens; only how
the draft ranks its candidates differs. Prints α and tokens per iteration for each tree.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenswift_trt.decode.loop import GenerationConfig, generate
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import PositionKeyedRandom, SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT.parent / "shared" / "corpus" / "pride_and_prejudice.txt"


class RankedByProbability(PositionKeyedRandom):
    """The same noise for sampling, hidden from the drafts (they rank by probability)."""

    noise_known_in_advance = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "swift-tiny"))
    parser.add_argument(
        "--prompt-file",
        default=str(HELD_OUT if HELD_OUT.is_file() else ROOT / "models" / "swift-tiny" / "prompt.txt"),
    )
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--kv-budget", type=int, default=4096)
    parser.add_argument("--trees", default="1,1,1,1;1,3,3,3")
    args = parser.parse_args()

    engine = load_engine(args.model_dir)
    prompt = TextCodec.from_dir(args.model_dir).encode(Path(args.prompt_file).read_text()[:50_000])[
        : args.prefix_len
    ]
    sampling = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=256)
    print(
        f"{len(prompt)}-token prompt, {args.tokens} new tokens, min-p 0.1, θ 1.2, W 256, B "
        f"{args.kv_budget}, k 0"
    )
    for tree in args.trees.split(";"):
        outputs = []
        for name, source in (("noise", PositionKeyedRandom(1)), ("probability", RankedByProbability(1))):
            config = GenerationConfig(
                max_new_tokens=args.tokens,
                sampling=sampling,
                tree=tree,
                ngram_topk=0,
                kv_budget=args.kv_budget,
                seed=1,
                ignore_eos=True,
            )
            tokens, stats = generate(engine, prompt, config, random=source)
            outputs.append(tokens)
            print(
                f"tree {tree}, ranked by {name}: α {stats.acceptance_rate:.3f}, "
                f"{stats.mean_accept_length:.2f} tokens/iteration, {stats.tokens_per_s:.1f} tokens/s",
                flush=True,
            )
        assert outputs[0] == outputs[1], "ranking changed the sampled tokens"


if __name__ == "__main__":
    main()
