"""Modeled speedup from measured iteration times, at tokens-per-iteration values a trie can commit.

    python -m tools.remodel_iterations docs/bench/gpu-h200-8b-curve/bench.json \
        --tau cap --tau smollm2-cpu=docs/bench/cpu-smollm2-tree333/bench.json \
        --tau smollm2-h100=docs/bench/gpu-h100-smollm2/bench.json --out docs/bench/gpu-h200-8b-curve/modeled

Reads a `bench --random-weights` run (its rows hold the measured ms per AR token and per TokenSwift
iteration at each prompt length) and models, for each τ (tokens committed per iteration), the speedup
per prompt length (τ x AR ms / iteration ms) and for a generation from the shortest prompt length to
each longer one (linear between the measured lengths). A τ is `cap` (the run's trie commits at most
its depth + 1 tokens per iteration), a number, or LABEL=bench.json of a real model's run (its tokens
per iteration: per prompt length the whole run's, weighted by generated length). A τ above the trie's
cap is refused. `--steady` times the tokens between a run's shortest and longest generation length
(graph captures and warm-up left out). Writes modeled.json and modeled.csv (tools/remodel.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from tools.remodel import RemodelError, Tau, remodel, run_tau, trie_cap


def parse_tau(spec: str, cap: int) -> Tau:
    if spec == "cap":
        return Tau("cap", float(cap), f"the trie's cap: depth + 1 = {cap}")
    label, _, source = spec.partition("=")
    if source:
        return Tau(label, run_tau(json.loads(Path(source).read_text())["rows"]), source)
    try:
        return Tau(spec, float(spec), "given")
    except ValueError:
        raise RemodelError(f"--tau {spec!r} is not cap, a number or LABEL=bench.json") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("--tau", action="append", required=True, help="cap, a number, or LABEL=bench.json")
    parser.add_argument(
        "--steady", action="store_true", help="time only the tokens after the shortest gen-len"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        report = json.loads(args.bench_json.read_text())
        cap = trie_cap(report["meta"]["tree"])
        result = remodel(report, [parse_tau(spec, cap) for spec in args.tau], steady=args.steady)
    except (RemodelError, OSError, KeyError, json.JSONDecodeError) as error:
        sys.exit(f"error: {error}")
    result = {
        "source": str(args.bench_json),
        "command": "python -m tools.remodel_iterations " + " ".join(sys.argv[1:]),
        **result,
    }
    per_context = result["per_context"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "modeled.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(args.out / "modeled.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(per_context[0]))
        writer.writeheader()
        writer.writerows(per_context)
    for tau in result["taus"]:
        label = tau["label"]
        last = result["long_runs"][label][-1] if result["long_runs"][label] else None
        print(
            f"τ {label} = {tau['tau']} ({tau['from']}): "
            + ", ".join(f"{row['prompt_length']}: {row[f'speedup_{label}']:.2f}x" for row in per_context)
            + (
                f"; {last['tokens']} tokens from {last['from_context']}: {last['modeled_speedup']:.2f}x"
                if last
                else ""
            )
        )


if __name__ == "__main__":
    main()
