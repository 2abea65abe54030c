"""Text the model writes itself, under the paper's sampling, as training data for its draft layers.

    python -m tools.generate_corpus --model-dir models/smollm2-135m --data data/corpus/iliad.txt \
        --data data/corpus/moby_dick.txt --data data/corpus/war_and_peace.txt \
        --out runs/generated.jsonl --sequences 1024 --batch 512 --new-tokens 1024 --device cuda

Verification accepts what the target samples, and the bench measures acceptance on text the model
writes, so draft layers trained on that text see the distribution they are scored on. Each sequence
continues a random `--prompt-len`-token stretch of the books (transformers' batched `generate`, the
model in bfloat16 on a GPU) with our own sampling transforms (`model.sampling.process_logits`:
the windowed contextual penalty θ over the last W tokens, then min-p, exactly as decoding applies
them). Writes one JSON line {"text": prompt + continuation} per sequence, as `train-heads --data`
reads them; a progress line per batch goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.sampling import SamplingConfig, process_logits


class PaperTransforms(LogitsProcessor):
    """Our decoding's transforms for every row: penalty over the row's last W tokens, then min-p."""

    def __init__(self, config: SamplingConfig) -> None:
        self.config = config

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        start = input_ids.shape[1] - min(self.config.penalty_window, input_ids.shape[1])
        window = input_ids[:, start:]  # [B, <= W] (empty when W = 0)
        return process_logits(scores, window, self.config)  # [B, V], -inf where excluded


def book_tokens(codec: TextCodec, files: list[Path]) -> torch.Tensor:
    return torch.tensor([t for file in files for t in codec.encode(file.read_text(encoding="utf-8"))])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--data", type=Path, action="append", required=True, help="book .txt (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help=".jsonl to write")
    parser.add_argument("--sequences", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--min-p", type=float, default=0.1)
    parser.add_argument("--penalty", type=float, default=1.2)
    parser.add_argument("--penalty-window", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args(argv)
    missing = [str(p) for p in [args.model_dir / "config.json", *args.data] if not p.is_file()]
    if missing:
        parser.error(f"missing: {', '.join(missing)}")
    if args.sequences < 1 or args.batch < 1 or args.prompt_len < 1 or args.new_tokens < 1:
        parser.error("--sequences, --batch, --prompt-len and --new-tokens must be positive")

    config = SamplingConfig(
        temperature=1.0, min_p=args.min_p, penalty=args.penalty, penalty_window=args.penalty_window
    )
    try:
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    codec = TextCodec.from_dir(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    books = book_tokens(codec, args.data)
    generator = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written, start = 0, time.time()
    with args.out.open("w", encoding="utf-8") as out:
        while written < args.sequences:
            count = min(args.batch, args.sequences - written)
            starts = torch.randint(0, books.numel() - args.prompt_len, (count,), generator=generator)
            prompts = torch.stack([books[s : s + args.prompt_len] for s in starts.tolist()])  # [B, P]
            with torch.no_grad():
                ids = model.generate(
                    prompts.to(args.device),
                    attention_mask=torch.ones_like(prompts, device=args.device),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,  # no EOS: long generation, as the bench's --ignore-eos
                    logits_processor=LogitsProcessorList([PaperTransforms(config)]),
                    pad_token_id=model.config.eos_token_id,
                )  # [B, P + new]
            for row in ids.tolist():
                out.write(json.dumps({"text": codec.decode(row)}) + "\n")
            out.flush()  # a run stopped by a time limit keeps its finished batches
            written += count
            rate = written * args.new_tokens / (time.time() - start)
            print(f"{written}/{args.sequences} sequences, {rate:.0f} new tokens/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
