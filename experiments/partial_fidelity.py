"""How faithful the partial KV cache is: level-1 acceptance of partial-cache drafting by context and budget.

    .venv/bin/python experiments/partial_fidelity.py [--contexts 512,2048,8192] [--budgets 128,256,1024]
    [--recent N]

With tree `1` and no n-grams the only draft is the base model's own next token computed on the
partial cache (sinks + top-scored positions + recent tokens) instead of the full cache, ranked with
the noise the target samples with. Its acceptance rate is therefore the share of positions where
attending to B selected positions gives the same sampled token as attending to all of them; a
budget at least as long as the context gives 1. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenswift_trt.decode.loop import GenerationConfig, generate
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT.parent / "shared" / "corpus" / "pride_and_prejudice.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "swift-tiny"))
    parser.add_argument("--prompt-file", default=str(HELD_OUT))
    parser.add_argument(
        "--contexts", default="512,2048,8192", help="prompt tokens (the context drafting starts at)"
    )
    parser.add_argument("--budgets", default="128,256,1024", help="partial cache budgets B")
    parser.add_argument(
        "--recent", type=int, default=None, help="recent region (selection redone when it fills) [B/4]"
    )
    parser.add_argument("--tokens", type=int, default=384, help="tokens generated per run")
    args = parser.parse_args()

    prompt_file = Path(args.prompt_file)
    if not prompt_file.is_file():
        parser.error(f"{prompt_file} not found: give --prompt-file (a long text)")
    engine = load_engine(args.model_dir)
    ids = TextCodec.from_dir(args.model_dir).encode(prompt_file.read_text())
    contexts = [int(c) for c in args.contexts.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    if max(contexts) > len(ids):
        parser.error(f"the prompt file has {len(ids)} tokens, fewer than context {max(contexts)}")
    sampling = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=256)
    recent = "B/4" if args.recent is None else args.recent
    print(
        f"min-p 0.1, θ 1.2, W 256, tree 1, k 0, {args.tokens} tokens, seed 1, recent region {recent}; α "
        "(selections)"
    )
    print("| context | " + " | ".join(f"B = {b}" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for context in contexts:
        row = []
        for budget in budgets:
            config = GenerationConfig(
                max_new_tokens=args.tokens,
                sampling=sampling,
                tree="1",
                ngram_topk=0,
                kv_budget=budget,
                kv_recent=args.recent,
                seed=1,
                ignore_eos=True,
            )
            _, stats = generate(engine, ids[:context], config)
            row.append(f"{stats.acceptance_rate:.3f} ({stats.partial_selections})")
        print(f"| {context:,} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
