"""Which first draft layer agrees more with the target's sample: a root MLP, or one causal-attention
decoder layer over the whole history (EAGLE-style)? An offline trial on cached base states.

    .venv/bin/python experiments/draft_input_trial.py [--chunks 600] [--positions 1430000] \
        [--features runs/draft-trial-features.pt]

Runs the base model over `--chunks` random 512-token stretches of the training books (Moby-Dick,
War and Peace, the Iliad; cached in `--features`), then trains, from the same start (the base
state passed through, so both begin by predicting x[t + 1]) and on the same number of positions,
two replacements for draft layer 1, each predicting x[t + 2] from the base state h_t and the
root's embedding e(x[t + 1]) with the base model's soft targets over the committed heads' draft
vocabulary:

- mlp: rmsnorm(h + D · silu(U · [rmsnorm(h); rmsnorm(e)])), width 2,304 (`train-heads --root-width`);
- attention: h + F · [rmsnorm(h); rmsnorm(e)], then one Llama decoder layer (9 heads, rotary
  positions, SwiGLU 1,536) attending to every earlier position's input, then rmsnorm.

Prints both variants' and the committed layer 1's coupled hit@1..8 (tools/first_level_agreement.py)
on text the model generated after the held-out book's opening and on that book's own text.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from first_level_agreement import HELD_OUT, PAPER_SAMPLING, coupled_draws, evaluation_text, hit_rates
from torch import nn

from tokenswift_trt.cli.common import load_source
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.kernels.ops import apply_rotary
from tokenswift_trt.model.draft_layers import RootMLP
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.training.train_heads import (
    base_hidden,
    base_logits,
    draft_logits,
    head_weight,
    root_embeddings,
)

CORPUS = HELD_OUT.parent
BOOKS = ("moby_dick", "war_and_peace", "iliad")
SEQ = 512


class Layer1MLP(nn.Module):
    """rmsnorm(h + RootMLP(h, e)): the runtime's root MLP (model/draft_layers.py) with D = 0, read
    out through a norm that starts as the base model's final one."""

    def __init__(self, hidden: int, width: int, final_norm: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.root = RootMLP(hidden, width, eps)
        self.post = nn.RMSNorm(hidden, eps=eps)
        nn.init.zeros_(self.root.down.weight)
        with torch.no_grad():
            self.post.weight.copy_(final_norm)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:  # [..., hidden] each
        return self.post(h + self.root(h, e))


def rotate(x: torch.Tensor) -> torch.Tensor:  # x [B, heads, T, head_dim], rotary positions 0..T-1
    head_dim, length = x.shape[-1], x.shape[-2]
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(length).float()[:, None] * inverse[None]  # [T, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)
    return apply_rotary(x, angles.cos(), angles.sin())


class AttentionLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, width: int, final_norm: torch.Tensor) -> None:
        super().__init__()
        self.heads = heads
        self.hidden_norm, self.root_norm = nn.RMSNorm(hidden, eps=1e-5), nn.RMSNorm(hidden, eps=1e-5)
        self.fuse = nn.Linear(2 * hidden, hidden, bias=False)
        self.attention_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.gate_up = nn.Linear(hidden, 2 * width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)
        self.post = nn.RMSNorm(hidden, eps=1e-5)
        for zero in (self.fuse, self.out, self.down):
            nn.init.zeros_(zero.weight)
        with torch.no_grad():
            self.post.weight.copy_(final_norm)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:  # [B, T, hidden] each
        batch, length, hidden = h.shape
        x = h + self.fuse(torch.cat((self.hidden_norm(h), self.root_norm(e)), dim=-1))
        q, k, v = (
            self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        )  # [B, heads, T, head_dim] each
        attended = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, hidden))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return self.post(x + self.down(F.silu(gate) * up))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--chunks", type=int, default=600, help="512-token stretches of base states")
    parser.add_argument("--positions", type=int, default=1_430_000, help="training positions per variant")
    parser.add_argument("--features", type=Path, default=Path("runs/draft-trial-features.pt"))
    args = parser.parse_args()
    torch.manual_seed(0)
    source = load_source(args.model, None, None, None, None, "cpu", True)
    engine, codec, layers = source.engine, source.codec, source.engine.draft_layers
    if layers is None or layers.vocab is None:
        raise SystemExit(f"{args.model}'s draft layers have no draft vocabulary to train over")
    weight = head_weight(engine)
    vocab_weight = weight[layers.vocab]  # [K, hidden]
    embedding = engine.model.model.embed_tokens.weight.detach().float()
    final_norm = engine.model.model.norm
    states, ids = cached_states(engine, codec, args.chunks, args.features)  # [C, SEQ, hidden], [C, SEQ]

    def soft_targets(rows: torch.Tensor) -> torch.Tensor:  # base states [..., hidden] -> [..., K]
        with torch.no_grad():
            return F.softmax(F.linear(final_norm(rows.float()), vocab_weight), dim=-1)

    hidden = states.shape[-1]
    variants = {
        "mlp": Layer1MLP(hidden, 2304, final_norm.weight.detach().float(), engine.config.rms_norm_eps),
        "attention": AttentionLayer(hidden, 9, 1536, final_norm.weight.detach().float()),
    }
    for name, net in variants.items():
        if name == "mlp":  # independent positions, 1,024 a step
            steps, lr = args.positions // 1024, 2e-3

            def batch(net: nn.Module = net) -> torch.Tensor:
                chunk = torch.randint(0, states.shape[0], (1024,))
                t = torch.randint(0, SEQ - 1, (1024,))
                predicted = net(states[chunk, t].float(), embedding[ids[chunk, t + 1]])
                return cross_entropy(F.linear(predicted, vocab_weight), soft_targets(states[chunk, t + 1]))

        else:  # whole stretches (causal attention), 4 a step
            steps, lr = args.positions // (4 * (SEQ - 1)), 1e-3

            def batch(net: nn.Module = net) -> torch.Tensor:
                chunk = torch.randint(0, states.shape[0], (4,))
                predicted = net(states[chunk, :-1].float(), embedding[ids[chunk, 1:]])
                return cross_entropy(F.linear(predicted, vocab_weight), soft_targets(states[chunk, 1:]))

        train(name, net, batch, steps, lr)
    text = codec.encode(HELD_OUT.read_text())
    for on in ("generated", "book"):
        sequence, start = evaluation_text(engine, text, on, SEQ, 1536)
        with torch.no_grad():
            h = base_hidden(engine, sequence)
            base = base_logits(engine, weight, h)
            roots = embedding[torch.cat((sequence[1:], sequence[-1:]))]
            committed = draft_logits(weight, layers, h, root_embeddings(engine, layers, sequence))[0]
            drafts = {"committed layer 1": committed}
            for name, net in variants.items():
                drafts[name] = F.linear(net(h[None], roots[None])[0], vocab_weight)
        for name, logits in drafts.items():
            draws = coupled_draws(base, logits, layers.vocab, sequence, start, PAPER_SAMPLING)
            ranks = [draw.rank for draw in draws]
            print(f"{on:9s} {name:18s} hit@1..8: {hit_rates(ranks)}", flush=True)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -(targets * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def cached_states(
    engine: Engine, codec: TextCodec, chunks: int, path: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    """The base model's last hidden states (float16) over `chunks` random stretches of the books."""
    if path.is_file():
        states, ids = torch.load(path)
        if states.shape[0] == chunks:
            return states, ids
    books = [codec.encode((CORPUS / f"{book}.txt").read_text()) for book in BOOKS]
    generator = torch.Generator().manual_seed(1)
    all_states, all_ids = [], []
    started = time.time()
    for i in range(chunks):
        book = books[i % len(books)]
        offset = int(torch.randint(0, len(book) - SEQ - 1, (1,), generator=generator))
        stretch = torch.tensor(book[offset : offset + SEQ])
        with torch.no_grad():
            all_states.append(base_hidden(engine, stretch).half())
        all_ids.append(stretch)
    states, ids = torch.stack(all_states), torch.stack(all_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save((states, ids), path)
    print(f"base states of {chunks} stretches in {time.time() - started:.0f} s", flush=True)
    return states, ids


def train(name: str, net: nn.Module, batch: Callable[[], torch.Tensor], steps: int, lr: float) -> None:
    """AdamW, 50 warm-up steps, cosine decay; the loss every 100 steps."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    started = time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = batch()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"{name} step {step} loss {loss.item():.3f} ({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
