"""The cascade settings a `gpu_variants_ab.py` run says to use, as `--kernel NAME=VALUE` lines.

    python3 -m tools.pick_cascade VARIANTS_JSON [--step verify_T64] [--margin 0.02]

Reads variants.json (median ms per step and variant), takes the fastest FlashAttention-cascade variant
at the longest context's STEP (a variant counts only where it beats plain `flash_cascade+fused` by
MARGIN), and prints both of the kernel settings it decides (`cascade_tail=kernel|torch`,
`cascade_prefix=triton|flash`) and the `auto` threshold re-derived against `kernel+fused`: for every
tree size timed at two contexts, each side's cost as a line in the context, the keys where they cross,
times T; the threshold is the mean of those products (`cascade_min_work`). Lines starting with `#` say
why. `gpu_checks.sh`'s `e2e-picked` stage passes the other lines to the CLI.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BASE, KERNEL = "flash_cascade+fused", "kernel+fused"
SWITCHES = {  # extra -> (its kernel setting on, off)
    "tail": ("cascade_tail=kernel", "cascade_tail=torch"),
    "triton": ("cascade_prefix=triton", "cascade_prefix=flash"),
}


def crossing_work(kernel: dict[int, float], cascade: dict[int, float], tree_size: int) -> float | None:
    """T x the keys where the cascade's cost line meets the kernel's (two contexts each), or None where
    the cascade never catches up (its slope no smaller)."""
    (c0, c1) = sorted(kernel)[:1] + sorted(kernel)[-1:]
    slope_k = (kernel[c1] - kernel[c0]) / (c1 - c0)
    slope_c = (cascade[c1] - cascade[c0]) / (c1 - c0)
    if slope_c >= slope_k:
        return None
    keys = c0 + (cascade[c0] - kernel[c0]) / (slope_k - slope_c)
    return max(keys, 1.0) * tree_size


def pick(rows: list[dict], step: str, margin: float) -> list[str]:
    ms = {(r["variant"], r["context"], r["step"]): r["ms"] for r in rows}
    contexts = sorted({r["context"] for r in rows})
    longest = contexts[-1]
    if (BASE, longest, step) not in ms:
        return [f"# no {BASE} {step} at {longest}: defaults kept"]
    base = ms[(BASE, longest, step)]
    best, best_ms = BASE, base
    for (variant, context, name), value in ms.items():
        if context == longest and name == step and variant.startswith(BASE + "+"):
            if value < best_ms and value <= base * (1 - margin):
                best, best_ms = variant, value
    lines = [f"# {step} at {longest} keys: {BASE} {base:.2f} ms, picked {best} {best_ms:.2f} ms"]
    extras = best.split("+")[2:]
    # both switches, on or off: the engine's defaults may differ from the variant that won
    lines += [f"--kernel {on if extra in extras else off}" for extra, (on, off) in SWITCHES.items()]
    works = []
    for name in sorted({r["step"] for r in rows if r["step"].startswith("verify_T")}):
        size = int(name.removeprefix("verify_T"))
        kernel = {c: ms[(KERNEL, c, name)] for c in contexts if (KERNEL, c, name) in ms}
        cascade = {c: ms[(best, c, name)] for c in contexts if (best, c, name) in ms}
        if size < 2 or len(kernel) < 2 or set(kernel) != set(cascade):
            continue
        work = crossing_work(kernel, cascade, size)
        where = "never crosses" if work is None else f"crosses at {work / size:.0f} keys"
        lines.append(f"# T={size}: {where}")
        if work is not None:
            works.append(work)
    if works:
        lines.append(f"--kernel cascade_min_work={round(statistics.mean(works))}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants_json", type=Path)
    parser.add_argument("--step", default="verify_T64")
    parser.add_argument("--margin", type=float, default=0.02)
    args = parser.parse_args()
    if not args.variants_json.is_file():
        raise SystemExit(f"{args.variants_json}: not found (run gpu_checks.sh's variants stage first)")
    rows = json.loads(args.variants_json.read_text())["rows"]
    print("\n".join(pick(rows, args.step, args.margin)))


if __name__ == "__main__":
    main()
