"""The figures by output position of bench runs (their rows' `windows`) drawn against position:
acceptance by draft depth (one line per depth), tokens per iteration, and tokens/s of TokenSwift and
of AR (the reference), one point per window."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

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


def plot_windows(runs: Sequence[tuple[str, Path] | tuple[str, Path, str]], out: Path) -> Path:
    """Draw the windows of each (label, bench JSON[, key]) in `runs` (per prompt length, its longest
    generation; `key` as `longest_rows` takes it) into the PNG `out`; returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
