"""The LM head's cost per step on GPUs under tensor parallelism, replicated or split over the
vocabulary: modeled from bytes and bandwidths (not measured).

    .venv/bin/python -m tools.tp_head_model docs/bench/cpu-tp2-head

writes gpu_model.json there: for Llama 3.1 8B (bfloat16) at --tp 2 on H100 SXM GPUs, per step of T
rows, the replicated head (every rank reads its whole weight from HBM) against the split one (each
rank reads its 1/N of the rows, then one all-gather of the [T, V] logits over NVLink, and the
concatenation's copy). The inputs are named in the file.
"""

from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path

from tokenswift_trt.builder.presets import PRESETS

ELEMENT = 2  # bfloat16 weights and logits
HBM_BYTES_S = 3.35e12  # H100 SXM (HBM3), datasheet
NVLINK_BYTES_S = 450e9  # H100 SXM NVLink 4, per direction (900 GB/s both ways), datasheet
ALL_GATHER_LATENCY_S = 15e-6  # an assumed NCCL all-gather of a small message between 2 NVLink GPUs
TOKENS = (1, 16, 64, 256)  # rows per step: AR, trees, a long match's branch


def rows(size: int = 2) -> list[dict]:
    config = PRESETS["llama3.1-8b"].config
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    head = vocab * hidden * ELEMENT
    mine = -(-vocab // size) * hidden * ELEMENT
    table = []
    for tokens in TOKENS:
        logits = tokens * vocab * ELEMENT
        received = logits * (size - 1) / size  # every rank receives the others' columns
        split_s = mine / HBM_BYTES_S + ALL_GATHER_LATENCY_S + received / NVLINK_BYTES_S
        split_s += 2 * logits / HBM_BYTES_S  # torch.cat: read and write the gathered logits
        table.append(
            {
                "tokens": tokens,
                "replicated_head_ms": round(head / HBM_BYTES_S * 1e3, 4),
                "vocab_head_ms": round(split_s * 1e3, 4),
                "head_bytes_per_rank_replicated": head,
                "head_bytes_per_rank_vocab": mine,
                "all_gather_bytes_received": int(received),
            }
        )
    return table


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "modeled": "not measured: bytes / bandwidth (+ an assumed all-gather latency)",
        "computed": str(date.today()),
        "model": "Llama 3.1 8B (vocab 128256, hidden 4096), bfloat16",
        "tp": 2,
        "hbm_bytes_s": HBM_BYTES_S,
        "nvlink_bytes_s_per_direction": NVLINK_BYTES_S,
        "all_gather_latency_s": ALL_GATHER_LATENCY_S,
        "command": "python -m tools.tp_head_model " + str(out),
    }
    path = out / "gpu_model.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows()}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/bench/cpu-tp2-head"))
