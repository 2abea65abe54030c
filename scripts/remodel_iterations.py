"""Modeled speedup from measured iteration times, at tokens-per-iteration values a trie can commit.

    python scripts/remodel_iterations.py docs/bench/gpu-h200-8b-curve/bench.json \
        --tau cap --tau smollm2-cpu=docs/bench/cpu-smollm2-tree333/bench.json \
        --tau smollm2-h100=docs/bench/gpu-h100-smollm2/bench.json --out docs/bench/gpu-h200-8b-curve/modeled

Reads a `bench --random-weights` run (its rows hold the measured ms per AR token and per TokenSwift
iteration at each prompt length) and models, for each τ (tokens committed per iteration), the speedup
per prompt length (τ x AR ms / iteration ms) and for a generation from the shortest prompt length to
each longer one (the bench's `modeled_long_run`, linear between the measured lengths). A τ is `cap`
(the run's trie commits at most its depth + 1 tokens per iteration), a number, or LABEL=bench.json of
a real model's run (its tokens per iteration, weighted by generated length). A τ above the trie's cap
is refused. Writes modeled.json and modeled.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from tokenswift_trt.cli.bench import modeled_long_run


def trie_cap(tree: str) -> int:
    """Most tokens one iteration of a static tree commits: every level accepted, plus the bonus token."""
    return len(tree.split(",")) + 1


def measured_tau(bench_json: Path) -> float:
    rows = json.loads(bench_json.read_text())["rows"]
    tokens = sum(row["gen_len"] for row in rows)
    return round(sum(row["tokens_per_iteration"] * row["gen_len"] for row in rows) / tokens, 3)


def parse_tau(spec: str, cap: int) -> tuple[str, float, str]:
    """(label, τ, where it comes from)."""
    if spec == "cap":
        return "cap", float(cap), f"the trie's cap: depth + 1 = {cap}"
    label, _, source = spec.partition("=")
    if source:
        return label, measured_tau(Path(source)), source
    return spec, float(spec), "given"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("--tau", action="append", required=True, help="cap, a number, or LABEL=bench.json")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = json.loads(args.bench_json.read_text())
    meta, rows = report["meta"], sorted(report["rows"], key=lambda row: row["prefix_len"])
    if "ar_ms_per_token" not in rows[0]:
        sys.exit(f"{args.bench_json} has no measured iteration times: use a `bench --random-weights` run")
    cap = trie_cap(meta["tree"])
    taus = [parse_tau(spec, cap) for spec in args.tau]
    for label, tau, _ in taus:
        if tau > cap:
            sys.exit(
                f"τ {label} = {tau} is above what tree {meta['tree']} can commit ({cap}); use at most {cap}"
            )
    per_context = [
        {
            "prompt_length": row["prefix_len"],
            "ar_ms_per_token": row["ar_ms_per_token"],
            "iteration_ms": row["tokenswift_ms_per_iteration"],
            "iteration_over_ar_step": row["iteration_over_ar_step"],
            **{
                f"speedup_{label}": round(
                    tau * row["ar_ms_per_token"] / row["tokenswift_ms_per_iteration"], 3
                )
                for label, tau, _ in taus
            },
        }
        for row in rows
    ]
    long_runs = {
        label: [modeled_long_run(rows[: end + 1], tau) for end in range(1, len(rows))]
        for label, tau, _ in taus
    }
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "source": str(args.bench_json),
        "command": "python scripts/remodel_iterations.py " + " ".join(sys.argv[1:]),
        "tree": meta["tree"],
        "ngram_topk": meta.get("ngram_topk"),
        "trie_cap": cap,
        "taus": [{"label": label, "tau": tau, "from": source} for label, tau, source in taus],
        "per_context": per_context,
        "long_runs": long_runs,
    }
    (args.out / "modeled.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(args.out / "modeled.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(per_context[0]))
        writer.writeheader()
        writer.writerows(per_context)
    for label, tau, source in taus:
        last = long_runs[label][-1]
        print(
            f"τ {label} = {tau} ({source}): "
            + ", ".join(f"{row['prompt_length']}: {row[f'speedup_{label}']:.2f}x" for row in per_context)
            + f"; {last['tokens']} tokens from {last['from_context']}: {last['modeled_speedup']:.2f}x"
        )


if __name__ == "__main__":
    main()
