"""Training curve of a `train-heads` run from its progress log (the tqdm lines it writes to stderr).

    .venv/bin/python -m tools.plot_training_log runs/heads-smollm2.log docs/bench/heads-smollm2/curve

writes curve.csv (step, loss: the mean cross-entropy of the three draft layers) and curve.png.
"""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STEP = re.compile(r"\| *(\d+)/(\d+) \[[^\]]*loss=([0-9.]+)\]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("out", type=Path, help="path prefix: OUT.csv and OUT.png are written")
    args = parser.parse_args()
    losses: dict[int, float] = {}
    for step, _, loss in STEP.findall(args.log.read_text(errors="replace")):
        losses[int(step)] = float(loss)  # the last postfix shown at a step is that step's loss
    steps = sorted(losses)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "loss"])
        writer.writerows((step, losses[step]) for step in steps)
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(steps, [losses[s] for s in steps])
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("mean cross-entropy of the 3 draft layers")
    axis.set_title(args.log.stem)
    figure.tight_layout()
    figure.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"{len(steps)} steps; wrote {args.out.with_suffix('.csv')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
