"""Weights and KV cache per GPU under tensor parallelism, computed from model configs (not measured).

    .venv/bin/python -m tools.tp_memory docs/bench/tp-memory

writes tp_memory.json and tp_memory.md there: for Llama 3.1 8B, DeepSeek-R1-Distill-Qwen-32B (the
Qwen2.5-32B shape) and Llama 3.1 70B at 102,400 positions in bfloat16, each valid --tp size up to 8:
the replicated weights (embedding, norms), the rank's slice of the layers and of the LM head (split
over the vocabulary, GPUs' default: `tensor_parallel.default_head`), its KV cache and the bytes each
forward all-reduces per new token (2 per layer x hidden). `tensor_parallel.rank_bytes`
does the arithmetic (tests/model/test_tensor_parallel.py checks it against loaded ranks).
"""

from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path

from tokenswift_trt.builder.presets import PRESETS
from tokenswift_trt.model.config import config_from_dict
from tokenswift_trt.model.tensor_parallel import default_head, rank_bytes, valid_sizes

POSITIONS = 102_400
ELEMENT = 2  # bfloat16
HEAD = default_head("nccl")  # the LM head's split on GPUs
GB = 1e9
# the shape fields of each model's config.json on the Hugging Face Hub
MODELS = {
    "Llama 3.1 8B": PRESETS["llama3.1-8b"].config,
    "DeepSeek-R1-Distill-Qwen-32B": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    "Llama 3.1 70B": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
}


def rows() -> list[dict]:
    table = []
    for name, raw in MODELS.items():
        config = config_from_dict(raw)
        for size in (s for s in valid_sizes(config) if s <= 8):
            replicated, split, kv = rank_bytes(config, size, POSITIONS, ELEMENT, HEAD)
            reduced = 2 * config.num_layers * config.hidden_size * ELEMENT  # o_proj and down, every layer
            table.append(
                {
                    "model": name,
                    "tp": size,
                    "replicated_weights_gb": round(replicated / GB, 2),
                    "split_weights_gb": round(split / GB, 2),
                    "weights_gb": round((replicated + split) / GB, 2),
                    "kv_cache_gb": round(kv / GB, 2),
                    "total_gb": round((replicated + split + kv) / GB, 2),
                    "all_reduce_kb_per_token": round(reduced / 1e3),
                }
            )
    return table


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table = rows()
    meta = {
        "computed": str(date.today()),
        "positions": POSITIONS,
        "dtype": "bfloat16",
        "lm_head": HEAD,
        "source": "computed from the model configs by tools/tp_memory.py (not measured); draft layers, "
        "activations and the CUDA context are not counted",
    }
    (out / "tp_memory.json").write_text(json.dumps({"meta": meta, "rows": table}, indent=1) + "\n")
    lines = [
        f"Computed from the model configs (not measured), bfloat16, {POSITIONS:,} positions, the LM "
        f"head split over the vocabulary at --tp 2 and up; draft layers, activations and the CUDA "
        "context not counted.",
        "",
        "| model | --tp | weights per GPU (GB) | of which replicated | KV cache per GPU (GB) "
        "| total per GPU (GB) | all-reduced per token per step (KB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table:
        lines.append(
            f"| {row['model']} | {row['tp']} | {row['weights_gb']} | {row['replicated_weights_gb']} | "
            f"{row['kv_cache_gb']} | {row['total_gb']} | {row['all_reduce_kb_per_token']} |"
        )
    (out / "tp_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/bench/tp-memory"))
