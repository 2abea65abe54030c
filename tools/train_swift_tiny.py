"""Train `swift-tiny`, the embedded default model: a byte-level BPE tokenizer (8K) and a ~9M
parameter GQA Llama on the public-domain books in data/corpus, with pride_and_prejudice.txt
held out. Writes a Hugging Face model directory (config, bf16 safetensors, tokenizer.json) and
`training.json` with the held-out perplexity.

    .venv/bin/python -m tools.train_swift_tiny --corpus data/corpus --out models/swift-tiny
    --minutes 45

Draft layers are trained afterwards with `tokenswift-trt train-heads` (see docs/swift-tiny.md).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

HELD_OUT = "pride_and_prejudice.txt"
BOS, EOS = "<s>", "</s>"


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(f) for f in files], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def encode_books(tokenizer: Tokenizer, files: list[Path]) -> torch.Tensor:
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for path in files:
        ids.extend(tokenizer.encode(path.read_text(encoding="utf-8")).ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def model_config(vocab_size: int, bos: int, eos: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        initializer_range=0.02,
    )


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, ids: torch.Tensor, seq_len: int, max_batches: int = 40) -> float:
    model.eval()
    usable = (ids.numel() - 1) // seq_len * seq_len
    windows = ids[:usable].view(-1, seq_len)[: max_batches * 8]
    losses = []
    for batch in windows.split(8):
        losses.append(model(batch, labels=batch).loss.item())
    model.train()
    return math.exp(sum(losses) / len(losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--out", type=Path, default=Path("models/swift-tiny"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--minutes", type=float, default=45.0, help="training time budget")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    books = sorted(p for p in args.corpus.glob("*.txt"))
    if not books:
        raise SystemExit(f"no .txt books in {args.corpus}: run make corpus")
    train_books = [p for p in books if p.name != HELD_OUT]
    held_out = [p for p in books if p.name == HELD_OUT]
    torch.manual_seed(args.seed)

    tokenizer = train_tokenizer(train_books, args.vocab_size)
    train_ids = encode_books(tokenizer, train_books)
    held_ids = encode_books(tokenizer, held_out)
    config = model_config(tokenizer.get_vocab_size(), tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS))
    model = LlamaForCausalLM(config)
    model.train()
    params = sum(p.numel() for p in model.parameters())

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget_s = args.minutes * 60
    warmup = 100
    start = time.perf_counter()
    step = 0
    bar = tqdm(desc="train swift-tiny", unit="step")
    while step < args.max_steps:
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            break
        progress = min(1.0, elapsed / budget_s)  # cosine over the time budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, train_ids.numel() - args.seq_len - 1, (args.batch,))
        batch = torch.stack([train_ids[o : o + args.seq_len] for o in offsets])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
    bar.close()

    ppl = perplexity(model, held_ids, args.seq_len)
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save(str(args.out / "tokenizer.json"))
    report = {
        "parameters": params,
        "steps": step,
        "tokens_seen": step * args.batch * args.seq_len,
        "train_tokens": train_ids.numel(),
        "held_out_tokens": held_ids.numel(),
        "held_out_book": HELD_OUT,
        "held_out_perplexity": round(ppl, 2),
        "minutes": round((time.perf_counter() - start) / 60, 1),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "lr": args.lr,
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
