"""The plots of docs/benchmarks.md, drawn from the committed runs under docs/bench/.

    .venv/bin/python -m tools.plot_benchmarks [--bench docs/bench] [--out docs/bench/plots]
    .venv/bin/python -m tools.plot_benchmarks --windows runs/a/bench.json [--windows runs/b/bench.json]
    .venv/bin/python -m tools.plot_benchmarks --run runs/bench [--out DIR]

Writes three PNGs (with --windows, only windows.png: acceptance by draft depth, tokens per iteration and
tokens/s of TokenSwift and AR against output position, one point per window, from the rows' `windows` of
each bench JSON, labelled by its folder; with --run, the plots of one `tokenswift-trt bench` or
`bench-steps` run, beside its files unless --out is given: from bench.json, speedup.png and alpha.png
against generated length, one line per prompt length; from steps.json, steps.png: ms per step by
context against the bandwidth floor, and the modeled speedup by generated length):
- speedup.png: measured speedup over AR by generated length (the CPU runs), and the modeled speedup of a
  generation from a 4K prompt by its length on the H200 (`tools/remodel_iterations.py`'s long runs,
  one line per assumed tokens-per-iteration);
- acceptance.png: acceptance by draft depth of the SmolLM2 runs;
- iteration.png: ms per AR token and per TokenSwift iteration by prompt length (8B shape, H200).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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


LINESTYLES = ("-", "--", ":", "-.")


def longest_rows(path: Path, key: str = "windows") -> list[dict]:
    """Per prompt length, the row of a bench JSON with the longest generation that has windows (under
    `key`: "windows", or "adapted_windows" for the adapted draft layers' run), its windows as "windows"."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is not a bench JSON ({error}): give the bench.json that bench wrote"
        ) from None
    longest: dict[int, dict] = {}
    for row in rows:
        if row.get(key) and row["gen_len"] >= longest.get(row["prefix_len"], {}).get("gen_len", 0):
            longest[row["prefix_len"]] = {**row, "windows": row[key]}
    if not longest:
        raise ValueError(f"{path} has no figures by position (windows): rerun bench to record them")
    return [longest[prefix_len] for prefix_len in sorted(longest)]


def windows_runs(paths: Sequence[Path]) -> list[tuple[str, Path, str]]:
    """(label, bench JSON, key) per run to draw: each JSON's windows labelled by its folder, and the
    adapted draft layers' windows beside them where the JSON has them (`bench --compare-adaptation`)."""
    runs = []
    for path in paths:
        runs.append((path.parent.name, path, "windows"))
        try:
            rows = json.loads(Path(path).read_text()).get("rows", [])
        except (OSError, ValueError, AttributeError):
            continue  # longest_rows names the problem
        if any(isinstance(row, dict) and row.get("adapted_windows") for row in rows):
            runs.append((f"{path.parent.name}, adapted", path, "adapted_windows"))
    return runs


def plot_windows(runs: Sequence[tuple[str, Path] | tuple[str, Path, str]], out: Path) -> Path:
    """Draw the windows of each (label, bench JSON[, key]) in `runs` (per prompt length, its longest
    generation; `key` as `longest_rows` takes it) into the PNG `out`; returns `out`."""
    curves = [
        (f"{run[0]}, prefix {row['prefix_len']:,}", row, (str(run[1]), row["prefix_len"]))
        for run in runs
        for row in longest_rows(*run[1:])
    ]
    ar_drawn: set[tuple[str, int]] = set()  # one AR line per bench JSON and prompt length
    figure, (alpha_axis, tau_axis, speed_axis) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (label, row, source) in enumerate(curves):
        windows = row["windows"]
        style = LINESTYLES[index % len(LINESTYLES)]
        x = [(window["start"] + min(window["end"], row["gen_len"])) / 2 for window in windows]
        depths = max(len(window["alpha_by_depth"]) for window in windows)
        for depth in range(depths):
            points = [
                (position, window["alpha_by_depth"][depth])
                for position, window in zip(x, windows)
                if depth < len(window["alpha_by_depth"]) and window["reached_by_depth"][depth]
            ]
            if points:
                alpha_axis.plot(
                    *zip(*points),
                    linestyle=style,
                    marker=".",
                    color=colors[depth % len(colors)],
                    label=f"depth {depth + 1}, {label}",
                )
        if any("beta" in window for window in windows):  # n-gram and long-match drafts accepted / drafted
            alpha_axis.plot(
                x,
                [window.get("beta", 0.0) for window in windows],
                style,
                marker="s",
                markersize=3,
                color="gray",
                label=f"β (n-gram branches), {label}",
            )
        color = colors[index % len(colors)]
        tau_axis.plot(
            x, [w["tokens_per_iteration"] for w in windows], style, marker=".", color=color, label=label
        )
        speed_axis.plot(
            x,
            [w["tokenswift_tokens_per_s"] for w in windows],
            style,
            marker=".",
            color=color,
            label=f"TokenSwift, {label}",
        )
        if source not in ar_drawn:  # runs of one bench share its AR run
            ar_drawn.add(source)
            label = f"{Path(source[0]).parent.name}, prefix {source[1]:,}"
            speed_axis.plot(
                x,
                [w["ar_tokens_per_s"] for w in windows],
                style,
                marker="x",
                color="black",
                label=f"AR, {label}",
            )
    size = curves[0][1]["windows"][0]["end"] - curves[0][1]["windows"][0]["start"]
    alpha_axis.set(
        ylabel="α: accepted / reached; β", ylim=(0, 1), title=f"By output position ({size}-token windows)"
    )
    tau_axis.set(ylabel="tokens per iteration", ylim=(0, None))
    speed_axis.set(xlabel="output position (tokens generated)", ylabel="tokens/s", ylim=(0, None))
    for axis in (alpha_axis, tau_axis, speed_axis):
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def plot_bench_run(path: Path, out: Path) -> list[Path]:
    """speedup.png and alpha.png from the bench JSON `path`: each against generated length, one line
    per prompt length; returns the PNGs written under `out`."""
    bench_rows = json.loads(Path(path).read_text())["rows"]
    written = []
    for key, label, name in (
        ("speedup", "speedup over AR (x)", "speedup.png"),
        ("alpha", "acceptance rate α", "alpha.png"),
    ):
        figure, axis = plt.subplots(figsize=(5, 3.5))
        for prefix_len in sorted({row["prefix_len"] for row in bench_rows}):
            points = [row for row in bench_rows if row["prefix_len"] == prefix_len]
            axis.plot(
                [row["gen_len"] for row in points],
                [row[key] for row in points],
                marker="o",
                label=f"prefix {prefix_len}",
            )
        if key == "speedup":
            axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        axis.set(xlabel="generated tokens", ylabel=label)
        axis.legend()
        figure.tight_layout()
        figure.savefig(out / name, dpi=120)
        plt.close(figure)
        written.append(out / name)
    return written


def plot_step_run(path: Path, out: Path) -> Path:
    """steps.png from the bench-steps JSON `path`: ms per step by context (dashed: its bandwidth floor)
    beside the modeled speedup by generated length, with the paper's A100 figures; returns the PNG."""
    report = json.loads(Path(path).read_text())
    meta, costs, speedups = report["meta"], report["steps"], report["speedup"]
    figure, (steps_axis, speedup_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for index, step in enumerate(dict.fromkeys(cost["step"] for cost in costs)):
        points = sorted((cost for cost in costs if cost["step"] == step), key=lambda cost: cost["context"])
        contexts = [cost["context"] for cost in points]
        color = f"C{index}"
        steps_axis.plot(contexts, [c["seconds"] * 1e3 for c in points], marker="o", color=color, label=step)
        steps_axis.plot(contexts, [c["bandwidth_seconds"] * 1e3 for c in points], "--", color=color)
    steps_axis.set(xlabel="context (cached positions)", ylabel="ms per step (dashed: bandwidth floor)")
    steps_axis.set_title(
        f"{meta.get('model', '')} {meta.get('dtype', '')} on {meta.get('device', '')}", fontsize=8
    )
    steps_axis.legend(fontsize=7)
    for mode in dict.fromkeys(row["mode"] for row in speedups):
        points = [row for row in speedups if row["mode"] == mode]
        speedup_axis.plot(
            [row["gen_length"] for row in points],
            [row["speedup"] for row in points],
            marker="o",
            label=f"{mode} drafting, τ {points[0]['accept_length']:g}, T {points[0]['tree_size']}",
        )
    paper = report.get("paper_a100_llama3.1_8b", {})
    speedup_axis.plot(
        [int(length) for length in paper],
        list(paper.values()),
        "kx",
        linestyle="none",
        label="paper: LLaMA3.1-8B, A100",
    )
    speedup_axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    speedup_axis.set(xlabel="generated tokens", ylabel="modeled speedup over AR (x)")
    speedup_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "steps.png", dpi=120)
    plt.close(figure)
    return out / "steps.png"


def plot_run(run: Path, out: Path) -> list[Path]:
    """The plots of the run folder `run` (bench.json and/or steps.json in it) under `out`."""
    written = []
    if (run / "bench.json").is_file():
        written += plot_bench_run(run / "bench.json", out)
    if (run / "steps.json").is_file():
        written.append(plot_step_run(run / "steps.json", out))
    if not written:
        raise ValueError(
            f"{run} holds neither bench.json nor steps.json: give the --out of a bench or bench-steps run"
        )
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, default=Path("docs/bench"))
    parser.add_argument(
        "--out",
        type=Path,
        help="folder of the PNGs [default: docs/bench/plots; with --run, the run's folder]",
    )
    parser.add_argument(
        "--windows",
        type=Path,
        action="append",
        metavar="BENCH_JSON",
        help="draw only windows.png (figures by output position) from these bench JSONs",
    )
    parser.add_argument(
        "--run",
        type=Path,
        metavar="DIR",
        help="draw the plots of one bench or bench-steps run from the bench.json / steps.json in DIR",
    )
    args = parser.parse_args()
    if args.run:
        out = args.out or args.run
        out.mkdir(parents=True, exist_ok=True)
        try:
            plot_run(args.run, out)
        except ValueError as error:
            parser.error(str(error))
        return
    args.out = args.out or Path("docs/bench/plots")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.windows:
        try:
            plot_windows(windows_runs(args.windows), args.out / "windows.png")
        except ValueError as error:
            parser.error(str(error))
        return
    plot_speedup(args.bench, args.out)
    plot_acceptance(args.bench, args.out)
    plot_iteration(args.bench, args.out)


if __name__ == "__main__":
    main()
