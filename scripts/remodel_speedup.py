"""Modeled speedup from a step-cost run's steps.json, for another verify tree size or host overhead.

    python scripts/remodel_speedup.py docs/bench/steps-h100/steps.json --tree-size 41 [--host-ms 1.0]

Same model as `tokenswift-trt bench-steps` (bench/steps.py), on the costs that run
measured; the tree size must be one of the run's --tree-sizes.
"""

from __future__ import annotations

import argparse
import json

from tokenswift_trt.bench.steps import StepCost, modeled_speedup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps_json")
    parser.add_argument("--tree-size", type=int, required=True)
    parser.add_argument(
        "--host-ms", type=float, default=None, help="default: the run's measured host overhead"
    )
    parser.add_argument("--gen-len", default="20480,40960,61440,81920,102400")
    args = parser.parse_args()
    report = json.load(open(args.steps_json))
    meta = report["meta"]
    costs = [StepCost(**step) for step in report["steps"]]
    host_ms = meta["host_overhead_ms"] if args.host_ms is None else args.host_ms
    rows = modeled_speedup(
        costs,
        meta["prompt_length"],
        [int(n) for n in args.gen_len.split(",")],
        meta["accept_length"],
        meta["verify_accept_length"],
        args.tree_size,
        host_ms / 1e3,
    )
    print(
        f"T {args.tree_size}, host {host_ms:.2f} ms, τ {meta['accept_length']} / "
        f"{meta['verify_accept_length']}"
    )
    print("gen_len | speedup partial | speedup verify")
    for partial, verify in zip(rows[::2], rows[1::2]):
        print(f"{partial.gen_length} | {partial.speedup:.2f} | {verify.speedup:.2f}")


if __name__ == "__main__":
    main()
