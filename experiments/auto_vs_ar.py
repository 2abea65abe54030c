"""`--tree auto` (or a static tree) against AR, interleaved in one process: per-step cost of
auto's AR steps and overall throughput (probes included), so that the machine's drift hits both alike.

    .venv/bin/python experiments/auto_vs_ar.py [--model-dir models/swift-tiny] [--tokens 1024] [--rounds 6]
        [--draft-source partial|verify] [--tree auto|TREE] [--ngram-topk K]

Paper sampling settings (min-p 0.1, θ 1.2, W 256, B 4096), seed 1, a 512-token held-out prompt.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tokenswift_trt.decode.autotune import PROBE_ITERATIONS
from tokenswift_trt.decode.loop import GenerationConfig, generate
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="models/swift-tiny")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--draft-source", default="partial", choices=["partial", "verify"])
    parser.add_argument("--tree", default="auto")
    parser.add_argument("--ngram-topk", type=int, default=20, help="static trees only (auto tunes k)")
    args = parser.parse_args()
    engine = load_engine(args.model_dir)
    codec = TextCodec.from_dir(args.model_dir)
    prompt = codec.encode((Path(args.model_dir) / "prompt.txt").read_text())[:512]
    sampling = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=256)
    base = dict(max_new_tokens=args.tokens, sampling=sampling, seed=1, ignore_eos=True, kv_budget=4096)
    step_ratios, rate_ratios = [], []
    swift_config = GenerationConfig(
        **base, tree=args.tree, ngram_topk=args.ngram_topk, draft_source=args.draft_source
    )
    for round_index in range(args.rounds):
        runs = {}
        for name in ("ar", "swift") if round_index % 2 == 0 else ("swift", "ar"):  # alternate who goes first
            config = GenerationConfig(**base, method="ar") if name == "ar" else swift_config
            runs[name] = generate(engine, prompt, config)
        (ar_tokens, ar), (swift_tokens, auto) = runs["ar"], runs["swift"]
        assert swift_tokens == ar_tokens, "TokenSwift must emit AR's tokens"
        ar_step = ar.phase_s["forward"] / ar.iterations * 1e3
        ar_iterations = max(1, auto.iterations - PROBE_ITERATIONS) if args.tree == "auto" else 1
        auto_step = auto.phase_s.get("ar_step", 0.0) / ar_iterations * 1e3
        step_ratios.append(auto_step / ar_step)
        rate_ratios.append(auto.tokens_per_s / ar.tokens_per_s)
        print(
            f"AR step {ar_step:.2f} ms, auto's AR steps {auto_step:.2f} ms; "
            f"AR {ar.tokens_per_s:.0f} tok/s, {args.tree} {auto.tokens_per_s:.0f} tok/s, "
            f"{auto.tokens_per_forward:.2f} tokens/forward ({', '.join(auto.plans)})"
        )
    print(
        f"median: auto's AR step / AR step {statistics.median(step_ratios):.3f}, "
        f"{args.tree} / AR throughput {statistics.median(rate_ratios):.3f} "
        f"(min {min(rate_ratios):.3f}, max {max(rate_ratios):.3f})"
    )


if __name__ == "__main__":
    main()
