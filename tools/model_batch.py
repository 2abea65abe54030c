"""Modeled: batched AR against batched TokenSwift for an 8B Llama on one GPU, by batch size and context.

A decode step of a batch reads the weights once and each request's whole KV cache once; TokenSwift's
verify step does the same for all of a request's tree tokens, so at long context (where the KV bytes
match or pass the weights') speculation keeps its gain as the batch grows, until the tree tokens'
arithmetic, not the bytes, sets the step time. This tool writes that roofline:

    step time = max(bytes read / effective bandwidth, FLOPs / effective compute) (+ the draft overhead)
    AR:         B tokens per step, B x 1 query token
    TokenSwift: B x tau tokens per step, B x `slots` query tokens, plus the draft passes

Inputs, all in the output: the model shape (Llama 3.1 8B: 8.03B parameters, 32 layers, 8 KV heads of
128, bf16); the GPU's HBM size; the effective bandwidth, fitted to the AR step times measured at
batch 1 on an H200 (docs/bench/gpu-h200-8b-curve), per context; the effective compute (an assumed
fraction of the dense bf16 peak, `--compute-efficiency`); the draft overhead per iteration, held at
its batch-1 measured value (measured iteration minus measured AR step); tau, the tokens an iteration
commits: the trie's cap (never more) and the value measured on SmolLM2-135M
(docs/bench/cpu-smollm2-tree333). Batch sizes whose caches do not fit beside the weights are marked.

    python -m tools.model_batch --out docs/bench/modeled-8b-batch
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenswift_trt.bench.compare import trie_cap

CURVE = Path("docs/bench/gpu-h200-8b-curve/modeled/modeled.json")  # measured AR and iteration ms (H200)
TAU_RUN = Path("docs/bench/cpu-smollm2-tree333/bench.json")


@dataclass(frozen=True)
class Shape:
    parameters: float = 8.03e9
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    attention_width: int = 4096  # query heads x head_dim
    bytes_per_value: int = 2  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value

    def flops(self, query_tokens: float, context: int) -> float:
        """Dense matmuls (2 per parameter) plus attention over `context` keys (QK and PV) per token."""
        attention = 4 * context * self.attention_width * self.layers
        return query_tokens * (2 * self.parameters + attention)


@dataclass(frozen=True)
class Gpu:
    name: str = "H200"
    memory_bytes: float = 141e9
    peak_flops: float = 989e12  # dense bf16


def measured_curve(path: Path) -> list[tuple[int, float, float]]:
    """(context, AR ms per token, iteration ms) at batch 1, measured."""
    data = json.loads(path.read_text())
    return [(c["prompt_length"], c["ar_ms_per_token"], c["iteration_ms"]) for c in data["per_context"]]


def measured_tau(path: Path) -> float:
    """Tokens per iteration of a measured run (its first row)."""
    row = json.loads(path.read_text())["rows"][0]
    for key in ("tokens_per_iteration", "accept_length", "mean_accepted"):
        if key in row:
            return float(row[key])
    raise SystemExit(f"{path}: no tokens-per-iteration field in its first row")


def model(
    shape: Shape,
    gpu: Gpu,
    curve: list[tuple[int, float, float]],
    taus: dict[str, float],
    slots: int,
    batches: list[int],
    compute_efficiency: float,
) -> list[dict]:
    rows = []
    compute = gpu.peak_flops * compute_efficiency
    for context, ar_ms, iteration_ms in curve:
        ar_bytes_1 = shape.weight_bytes + context * shape.kv_bytes_per_token
        bandwidth = ar_bytes_1 / (ar_ms / 1e3)  # fitted: the measured batch-1 AR step is memory-bound
        overhead_s = max(0.0, iteration_ms - ar_ms) / 1e3  # draft passes etc., at batch 1
        for batch in batches:
            kv = batch * context * shape.kv_bytes_per_token
            fits = shape.weight_bytes + kv <= gpu.memory_bytes
            ar_s = max((shape.weight_bytes + kv) / bandwidth, shape.flops(batch, context) / compute)
            verify_s = max(
                (shape.weight_bytes + kv) / bandwidth, shape.flops(batch * slots, context) / compute
            )
            ts_s = verify_s + overhead_s
            row = {
                "context": context,
                "batch": batch,
                "fits": fits,
                "kv_over_weights": round(kv / shape.weight_bytes, 3),
                "ar_step_ms": round(ar_s * 1e3, 3),
                "tokenswift_iteration_ms": round(ts_s * 1e3, 3),
                "ar_tokens_per_s": round(batch / ar_s, 1),
            }
            for label, tau in taus.items():
                row[f"speedup_{label}"] = round(tau * ar_s / ts_s, 3)
            rows.append(row)
    return rows


def markdown(document: dict) -> str:
    labels = list(document["taus"])
    lines = [
        "# Modeled: batched AR vs batched TokenSwift, Llama 3.1 8B shape on one H200",
        "",
        "Modeled, not measured: inputs and formula in `model.json` and `tools/model_batch.py`. "
        f"Tree slots per request: {document['slots']}; tau: "
        + ", ".join(f"{label} = {tau}" for label, tau in document["taus"].items())
        + f". Effective compute: {document['compute_efficiency']:.0%} of the dense bf16 peak (assumed).",
        "",
        "| context | batch | KV / weights | AR step ms | TokenSwift iteration ms | "
        + " | ".join(f"speedup at tau {label}" for label in labels)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(labels),
    ]
    for row in document["rows"]:
        if not row["fits"]:
            cells = ["does not fit"] * (2 + len(labels))
        else:
            cells = [f"{row['ar_step_ms']:.1f}", f"{row['tokenswift_iteration_ms']:.1f}"] + [
                f"{row[f'speedup_{label}']:.2f}x" for label in labels
            ]
        lines.append(
            f"| {row['context']:,} | {row['batch']} | {row['kv_over_weights']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--curve", type=Path, default=CURVE)
    parser.add_argument("--tau-run", type=Path, default=TAU_RUN)
    parser.add_argument("--tree", default="3,3,3")
    parser.add_argument("--ngram-topk", type=int, default=4)
    parser.add_argument("--slots", type=int, default=52, help="query tokens per request in a verify pass")
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--compute-efficiency", type=float, default=0.6)
    args = parser.parse_args()
    shape, gpu = Shape(), Gpu()
    cap = trie_cap(args.tree)
    taus = {"cap": float(cap), "smollm2": round(measured_tau(args.tau_run), 3)}
    taus = {label: min(tau, float(cap)) for label, tau in taus.items()}  # never past the trie's cap
    batches = [int(b) for b in args.batches.split(",")]
    rows = model(shape, gpu, measured_curve(args.curve), taus, args.slots, batches, args.compute_efficiency)
    document = {
        "modeled": True,
        "date": datetime.date.today().isoformat(),
        "command": "python -m tools.model_batch "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "shape": asdict(shape),
        "gpu": asdict(gpu),
        "curve": str(args.curve),
        "tau_run": str(args.tau_run),
        "tree": args.tree,
        "slots": args.slots,
        "taus": taus,
        "compute_efficiency": args.compute_efficiency,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model.json").write_text(json.dumps(document, indent=2) + "\n")
    (args.out / "README.md").write_text(markdown(document))
    print(markdown(document))


if __name__ == "__main__":
    main()
