"""The picture of a `train-heads` run: its loss by step and each draft layer's held-out acceptance
by step (from the report's `history` and `evaluations`), written beside report.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def acceptance_series(evaluations: list[dict[str, Any]]) -> tuple[str, list[list[float]]]:
    """(what is plotted, per layer its value at each evaluation): the coupled acceptance under the
    teacher's sampling where the run measured it, else agreement with the base's top-1 (greedy)."""
    sampled = bool(evaluations) and all(entry.get("draft_coupled_acceptance") for entry in evaluations)
    key = "draft_coupled_acceptance" if sampled else "draft_agrees_with_base"
    label = "acceptance under sampling" if sampled else "agreement with the base's top-1"
    layers = len(evaluations[0][key]) if evaluations else 0
    return label, [[entry[key][layer] for entry in evaluations] for layer in range(layers)]


def plot_report(report: dict[str, Any], path: Path) -> Path:
    """Draw the run's loss and acceptance curves to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history, evaluations = report.get("history", []), report.get("evaluations", [])
    figure, (loss_axis, accept_axis) = plt.subplots(1, 2, figsize=(10, 3.6))
    loss_axis.plot([e["step"] for e in history], [e["loss"] for e in history], linewidth=1)
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel(f"training loss ({report.get('config', {}).get('loss', '')})")
    label, series = acceptance_series(evaluations)
    steps = [entry["step"] for entry in evaluations]
    for layer, values in enumerate(series, start=1):
        accept_axis.plot(steps, values, marker="o", markersize=3, label=f"layer {layer}")
    accept_axis.set_xlabel("optimizer step")
    accept_axis.set_ylabel(f"held-out {label}")
    if series:
        accept_axis.legend()
    else:
        accept_axis.text(0.5, 0.5, "no evaluation during the run (--eval-every)", ha="center")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
