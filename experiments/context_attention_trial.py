"""Would draft layer 1 accept more if it could attend to earlier positions? An offline trial.

    .venv/bin/python experiments/context_attention_trial.py [--sequences 1200] [--steps 600] \
        [--lr 1e-3] [--batch 4] [--tune-all [--no-attention]] [--cache FILE]

The committed SmolLM2 layer 1 drafts x[t + 2] from the target's state at t and the root x[t + 1]
alone. This trial inserts a causal self-attention sublayer (9 heads of 64, rotary positions, its
output projection zero-initialised, so step 0 is exactly the committed drafter) after the root
input: row t attends to rows 0..t of the same input, all of which decoding knows (the verify pass's
states of committed tokens and the tokens after them), so an induction-style lookup (x[t + 1] seen
before, followed by y) becomes possible. Trained with `train-heads`' `sampled` loss (the target's
penalised, min-p-cut distribution over the draft vocabulary) on cached target states of
`--sequences` random 512-token stretches of the three training books (~0.45-0.55 s each on 2 cores;
`--cache FILE` keeps them for the next run), the committed layers frozen unless `--tune-all` (then
at a tenth of the learning rate; `--no-attention` is its control, the same fine-tuning without the
sublayer). Prints, on 12 x 512 positions of the held-out Pride and Prejudice, layer 1's
chance that its first draft is the target's sample under the paper's sampling
(`training.train_heads.coupled_acceptance`, as `experiments/held_out_acceptance.py`), at the start and
every 200 steps. Scratch-sized: nothing is saved but the cache.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenswift_trt.cli.common import CliError, load_source
from tokenswift_trt.kernels.ops import apply_rotary
from tokenswift_trt.model.config import ModelConfig
from tokenswift_trt.model.draft_layers import DraftLayers
from tokenswift_trt.model.rope import RotaryEmbedding
from tokenswift_trt.model.sampling import SamplingConfig
from tokenswift_trt.training.train_heads import (
    CachedStates,
    TrainHeadsConfig,
    base_hidden,
    base_logits,
    coupled_acceptance,
    evaluation_sequences,
    head_weight,
    lr_at,
    penalise,
    root_embeddings,
    sampled_teacher,
)

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"
TRAIN_BOOKS = ("moby_dick", "war_and_peace", "iliad")
SAMPLING = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=256)
SEQ_LEN = 512


class ContextAttention(nn.Module):
    """s + O · attention(rmsnorm(s)) over rows 0..t, O zero-initialised."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads, self.rotary = config.num_heads, RotaryEmbedding(config)
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        nn.init.normal_(self.qkv.weight, std=hidden**-0.5)
        nn.init.zeros_(self.out.weight)

    def forward(self, state: torch.Tensor) -> torch.Tensor:  # [B, T, hidden]
        batch, length, hidden = state.shape
        qkv = self.qkv(self.norm(state)).view(batch, length, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, T, D]
        cos, sin = self.rotary.cos_sin(torch.arange(length), state.dtype)  # [T, D] each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return state + self.out(mixed.transpose(1, 2).reshape(batch, length, hidden))


def cached_states(engine, codec, count: int, cache: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, SEQ_LEN], target states [N, SEQ_LEN, hidden] float16 of random training stretches."""
    if cache is not None and cache.is_file():
        data = torch.load(cache)
        return data["ids"], data["states"]
    ids = torch.cat(
        [torch.tensor(codec.encode((CORPUS / f"{book}.txt").read_text())) for book in TRAIN_BOOKS]
    )

    def progress(done: int) -> None:
        if done % 100 == 0:
            print(f"cached {done} / {count} sequences", flush=True)

    # `train-heads --state-cache`'s cache: starts drawn with seed + 1 = 7
    cached = CachedStates.build(
        engine, ids, TrainHeadsConfig(seq_len=SEQ_LEN, seed=6, state_cache=count), progress
    )
    sequences, states = cached.ids, cached.states
    if cache is not None:
        torch.save({"ids": sequences, "states": states}, cache)
    return sequences, states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=1200)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tune-all", action="store_true", help="train the committed layers too (lr / 10)")
    parser.add_argument("--no-attention", action="store_true", help="the control: --tune-all without it")
    parser.add_argument("--cache", type=Path, default=None, help="file to keep the cached states in")
    args = parser.parse_args()
    if args.no_attention and not args.tune_all:
        raise SystemExit("--no-attention trains nothing without --tune-all")
    if not (CORPUS / "pride_and_prejudice.txt").is_file():
        raise SystemExit(f"the corpus is not at {CORPUS}: this trial needs ../shared/corpus")
    torch.manual_seed(0)
    try:
        source = load_source("smollm2-135m", None, None, None, None, "cpu", True)
    except CliError as error:  # the model is not prepared: the message names `make models`
        raise SystemExit(str(error)) from None
    engine = source.engine
    engine.model.requires_grad_(False)
    weight = head_weight(engine)
    committed = engine.draft_layers
    vocab = committed.vocab
    rows = weight.index_select(0, vocab)  # [K, hidden]: the draft vocabulary's head rows
    drafter = DraftLayers(engine.config, len(committed), True, vocab.numel(), committed.root_width).float()
    drafter.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in committed.state_dict().items()}
    )
    context = ContextAttention(engine.config)
    for parameter in drafter.parameters():
        parameter.requires_grad_(args.tune_all)
    attend = not args.no_attention
    groups = [{"params": list(context.parameters()), "lr": args.lr, "base": args.lr}] if attend else []
    if args.tune_all:
        groups.append({"params": list(drafter.parameters()), "lr": args.lr / 10, "base": args.lr / 10})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)

    def layer1_logits(hidden: torch.Tensor, roots: torch.Tensor, attend: bool = attend) -> torch.Tensor:
        state = hidden + drafter.root(hidden, roots)  # [B, T, hidden]
        if attend:
            state = context(state)
        return F.linear(drafter.layers[0].step(state)[1], rows)  # [B, T, K]

    held_out = torch.tensor(source.codec.encode((CORPUS / "pride_and_prejudice.txt").read_text()))
    evaluation = []
    with torch.no_grad():
        for ids in evaluation_sequences(held_out, SEQ_LEN, 12):
            hidden = base_hidden(engine, ids)
            drawn = sampled_teacher(base_logits(engine, weight, hidden), ids, None, SAMPLING)
            evaluation.append((hidden, root_embeddings(engine, drafter, ids), drawn))

    @torch.no_grad()
    def held_out_hit(attend: bool = attend) -> float:
        hits = [
            coupled_acceptance(vocab, drawn, layer1_logits(h[None], r[None], attend)[0], 1, SAMPLING)
            for h, r, drawn in evaluation
        ]
        return float(torch.cat(hits).mean())

    print(f"held-out layer-1 coupled hit, committed: {held_out_hit(False):.4f}", flush=True)
    ids_all, states = cached_states(engine, source.codec, args.sequences, args.cache)
    order = torch.Generator().manual_seed(1)
    schedule = TrainHeadsConfig(
        steps=args.steps, lr=1.0, warmup_steps=30
    )  # `train-heads`' warm-up and cosine
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = group["base"] * lr_at(step - 1, schedule)
        pick = torch.randint(0, ids_all.shape[0], (args.batch,), generator=order)
        ids, hidden = ids_all[pick], states[pick].float()
        with torch.no_grad():
            roots = torch.stack([root_embeddings(engine, drafter, s) for s in ids])
            teachers = [
                sampled_teacher(base_logits(engine, rows, h), s, vocab, SAMPLING) for h, s in zip(hidden, ids)
            ]
        logits = layer1_logits(hidden, roots)
        loss = torch.zeros(())
        for b, (teacher, windows) in enumerate(teachers):  # row t drafts x[t + 2]: the teacher's row t + 1
            student = penalise(logits[b, :-2], windows[1:-1], SAMPLING.penalty)
            loss = loss - (teacher[1:-1] * F.log_softmax(student, -1)).sum(-1).mean() / args.batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 200 == 0 or step == args.steps:
            print(
                f"step {step}: loss {loss.item():.4f}, held-out layer-1 coupled hit {held_out_hit():.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
