"""The plots of docs/benchmarks.md, drawn from the committed runs under docs/bench/.

    .venv/bin/python -m tools.plot_benchmarks [--bench docs/bench] [--out docs/bench/plots]
    .venv/bin/python -m tools.plot_benchmarks --windows runs/a/bench.json [--windows runs/b/bench.json]

Writes three PNGs (with --windows, only windows.png: acceptance by draft depth, tokens per iteration and
tokens/s of TokenSwift and AR against output position, one point per window, from the rows' `windows` of
each bench JSON, labelled by its folder):
- speedup.png: measured speedup over AR by generated length (the CPU runs), and the modeled speedup of a
  generation from a 4K prompt by its length on the H200 (`tools/remodel_iterations.py`'s long runs,
  one line per assumed tokens-per-iteration);
- acceptance.png: acceptance by draft depth of the SmolLM2 runs;
- iteration.png: ms per AR token and per TokenSwift iteration by prompt length (8B shape, H200).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenswift_trt.bench.plot_windows import plot_windows  # noqa: E402

MEASURED_SPEEDUP = {  # run directory -> label
    "cpu-xeon-smollm2": "Xeon (AVX-512), default",
    "cpu-avx2-smollm2": "EPYC (AVX2), default",
    "cpu-xeon-smollm2-tree3-1k": "Xeon (AVX-512), tree 3",
    "gpu-h100-smollm2": "H100 (bf16), default",
}
ACCEPTANCE = {
    "cpu-xeon-smollm2": "Xeon, default (--tree auto)",
    "cpu-avx2-smollm2": "EPYC AVX2, default (--tree auto)",
    "cpu-xeon-smollm2-tree3-1k": "Xeon, tree 3",
    "cpu-smollm2-tree333": "EPYC AVX-512, tree 3,3,3 + 4 n-grams",
}
ITERATION = {
    "gpu-h200-8b-curve": "tree 3,3,3 + 4 n-grams (52 slots)",
    "gpu-h200-8b-k20": "tree 3,3,3 + 20 n-grams (100 slots)",
}
MODELED = "gpu-h200-8b-curve/modeled/modeled.json"


def rows(bench: Path, run: str) -> list[dict]:
    path = bench / run / "bench.json"
    return json.loads(path.read_text())["rows"] if path.is_file() else []


def plot_speedup(bench: Path, out: Path) -> None:
    figure, (measured, modeled) = plt.subplots(1, 2, figsize=(11, 4))
    for run, label in MEASURED_SPEEDUP.items():
        points = sorted(
            (row["gen_len"], row["speedup"], row["speedup_min"], row["speedup_max"])
            for row in rows(bench, run)
        )
        if points:
            x, y, low, high = zip(*points)
            errors = [[a - b for a, b in zip(y, low)], [b - a for a, b in zip(y, high)]]
            measured.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=label)
    measured.axhline(1.0, color="grey", linewidth=0.8)
    measured.set(
        xticks=[1024, 2048, 4096],
        xticklabels=["1,024", "2,048", "4,096"],
        xlabel="generated tokens",
        ylabel="speedup over AR (x)",
        title="Measured: SmolLM2-135M (min-max of repeats)",
    )
    measured.legend(fontsize=8)
    report = json.loads((bench / MODELED).read_text())
    for tau in report["taus"]:
        runs = report["long_runs"][tau["label"]]
        modeled.plot(
            [0] + [run["tokens"] for run in runs],
            [
                tau["tau"]
                * report["per_context"][0]["ar_ms_per_token"]
                / report["per_context"][0]["iteration_ms"]
            ]
            + [run["modeled_speedup"] for run in runs],
            marker="o",
            label=f"τ {tau['tau']:g}: {tau['label']}",
        )
    modeled.axhline(1.0, color="grey", linewidth=0.8)
    modeled.set(
        xlabel="tokens generated after a 4,096-token prompt",
        ylabel="modeled speedup over AR (x)",
        title=f"Modeled: 8B shape, H200, tree {report['tree']} (cap τ {report['trie_cap']})",
    )
    modeled.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "speedup.png", dpi=110)
    plt.close(figure)


def plot_acceptance(bench: Path, out: Path) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    runs = [(label, row) for run, label in ACCEPTANCE.items() for row in rows(bench, run)[-1:]]
    width = 0.8 / max(len(runs), 1)
    for index, (label, row) in enumerate(runs):
        by_depth = [float(alpha) for alpha in str(row["alpha_by_depth"]).split("/") if alpha]
        depths = [depth + (index - (len(runs) - 1) / 2) * width for depth in range(1, len(by_depth) + 1)]
        axis.bar(depths, by_depth, width=width, label=f"{label}, {row['gen_len']:,} tokens")
    axis.set(
        xlabel="draft depth",
        ylabel="accepted / reached",
        xticks=[1, 2, 3],
        title="SmolLM2-135M: acceptance by draft depth (paper sampling)",
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "acceptance.png", dpi=110)
    plt.close(figure)


def plot_iteration(bench: Path, out: Path) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    for index, (run, label) in enumerate(ITERATION.items()):
        points = sorted(
            (row["prefix_len"], row["ar_ms_per_token"], row["tokenswift_ms_per_iteration"])
            for row in rows(bench, run)
        )
        context, ar_ms, iteration_ms = zip(*points)
        axis.plot(context, iteration_ms, marker="o", label=f"TokenSwift iteration, {label}")
        if index == 0:
            axis.plot(context, ar_ms, marker="s", color="black", label="AR step")
    axis.set(
        xlabel="prompt length (tokens)",
        ylabel="ms",
        ylim=(0, None),
        title="8B shape on an H200 (bf16, random weights): measured step times",
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "iteration.png", dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, default=Path("docs/bench"))
    parser.add_argument("--out", type=Path, default=Path("docs/bench/plots"))
    parser.add_argument(
        "--windows",
        type=Path,
        action="append",
        metavar="BENCH_JSON",
        help="draw only windows.png (figures by output position) from these bench JSONs",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.windows:
        try:
            plot_windows([(path.parent.name, path) for path in args.windows], args.out / "windows.png")
        except ValueError as error:
            parser.error(str(error))
        return
    plot_speedup(args.bench, args.out)
    plot_acceptance(args.bench, args.out)
    plot_iteration(args.bench, args.out)


if __name__ == "__main__":
    main()
