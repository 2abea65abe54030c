"""Draft-layer acceptance along a long generation, static against adapted, replayed offline.

`record` generates a continuation with AR under the paper's sampling (min-p 0.1, θ 1.2, W 256) and
keeps its tokens and the target's hidden states (one chunked forward over the whole sequence).
`replay` walks the recorded positions a block at a time: it drafts every position with the static
layers or with a request's `DraftAdapter` (model/draft_adaptation.py), ranking drafts with the
target's own sampling noise as decoding does, and then lets the adapter observe the block, so each
draft reads only positions before it. Per window of output positions it writes layer 1's chance
that its draft is the sampled token (the bench's alpha_d1 counts the same event at iteration roots),
layers 2 and 3's given the depth before, the share of sampled tokens inside the draft
vocabulary, and the target's own top-1 probability at layer 1's position (how peaked the text's
distribution is there: a drafter that always proposed the target's most likely token would be
accepted that often; drafts ranked with the target's noise, as here, can be accepted more often).
A replay takes a minute or two where `bench --compare-adaptation` takes half an hour, so it is the
place to try adaptation settings; the bench measures the chosen one. `summarize` turns replays into
markdown rows.

    .venv/bin/python experiments/adaptation_replay.py record --model-dir models/smollm2-135m \\
        --prompt-file data/corpus/pride_and_prejudice.txt --seed 0 --out /tmp/book-0.pt
    .venv/bin/python experiments/adaptation_replay.py replay /tmp/book-0.pt --model-dir models/smollm2-135m
    .venv/bin/python experiments/adaptation_replay.py replay /tmp/book-0.pt --model-dir models/smollm2-135m \\
        --adapt --vocab draft --lr 1e-3
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch

import tokenswift_trt as ts
from tokenswift_trt.decode.state import engine_adapter
from tokenswift_trt.model.draft_adaptation import OPTIMIZERS, SCOPES, AdaptationSettings, copy_draft_layers
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.linear import pack_linears
from tokenswift_trt.model.sampling import SamplingConfig, position_gumbel_rows, process_logits

PAPER = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=256)


def record(args: argparse.Namespace) -> None:
    model = ts.load(model_dir=args.model_dir)
    prompt = model.codec.encode(args.prompt_file.read_text()[:20000])[: args.prefix_len]
    result = ts.generate(
        model,
        prompt,
        args.tokens,
        method="ar",
        temperature=PAPER.temperature,
        min_p=PAPER.min_p,
        penalty=PAPER.penalty,
        penalty_window=PAPER.penalty_window,
        seed=args.seed,
    )
    ids = torch.tensor(prompt + list(result.token_ids))  # [N]
    engine, config = model.engine, model.engine.config
    cache = KVCache(
        config.num_layers, config.num_kv_heads, config.head_dim, ids.numel(), engine.dtype, engine.device
    )
    hidden = []
    with torch.inference_mode():
        for start in range(0, ids.numel(), 512):
            chunk = ids[start : start + 512]
            positions = torch.arange(start, start + chunk.numel())
            hidden.append(engine.model(chunk, positions, cache).hidden.float().clone())  # [n, hidden]
            cache.commit()
    torch.save(
        {"ids": ids, "hidden": torch.cat(hidden), "prompt_len": len(prompt), "seed": args.seed}, args.out
    )


def replay(args: argparse.Namespace) -> None:
    data = torch.load(args.recording)
    ids, hidden, first, seed = (
        data["ids"],
        data["hidden"],
        data["prompt_len"],
        data["seed"],
    )  # [N], [N, hidden]
    model = ts.load(model_dir=args.model_dir)
    engine = model.engine
    size = engine.model.torch_model.lm_head.weight.shape[0]
    index = torch.arange(size)
    window = PAPER.penalty_window
    settings = AdaptationSettings(
        block=args.block,
        span=args.span,
        scope=args.scope,
        optimizer=args.optimizer,
        vocab=args.vocab,
        lr=args.lr,
        beta2=args.beta2,
        warmup=args.warmup,
        steps=args.steps,
    )
    adapter = engine_adapter(engine, ids, first, PAPER, settings)
    draftable = torch.zeros(size, dtype=torch.bool)
    draftable[engine.draft_layers.vocab if engine.draft_layers.vocab is not None else index] = True

    def windows(last: torch.Tensor) -> torch.Tensor:  # last [B] -> [B, W]: ids p - W + 1 .. p
        offsets = torch.arange(window) - (window - 1)
        return ids[torch.maximum(last[:, None] + offsets, (last - (window - 1)).clamp(min=0)[:, None])]

    end = ids.numel() - 4
    for _ in range(args.hindsight):  # adapt over the whole text first; measure the result frozen
        gap = True
        for start in range(first - 1, end, args.block):
            if args.hold_out_odd and (start - first + 1) // args.window % 2:
                gap = True
                continue
            if gap:  # the positions held end before a gap: no step pairs a row with one across it
                adapter.positions, adapter.hidden, adapter.pending = [], [], 0
                gap = False
            p = torch.arange(start, min(start + args.block, end))  # [B]
            adapter.observe(start, hidden[p].to(engine.dtype), ids[p + 1].tolist())
    adapter.finish()  # CUDA: the last step's result drafts
    snapshots = []
    lagged = copy_draft_layers(engine.draft_layers, engine.config, engine.dtype) if args.lag else None
    hits = []  # per block [B, 3]: layer d's draft at p is x[p + 1 + d]
    peaks = []  # per block [B]: the target's top-1 probability at p + 2
    for start in range(first - 1, end, args.block):
        p = torch.arange(start, min(start + args.block, end))  # [B]
        layers = adapter.layers if args.adapt or args.hindsight else engine.draft_layers
        if args.lag:  # the parameters one step older (the vocabulary head is current)
            snapshots.append({k: v.detach().clone() for k, v in adapter.layers.state_dict().items()})
            if len(snapshots) > 1:
                with torch.inference_mode(False):
                    lagged.load_state_dict(snapshots.pop(0))
                pack_linears(lagged, half=True, kernels=engine.kernels)
                lagged.vocab_head = adapter.layers.vocab_head
                layers = lagged
        with torch.inference_mode():
            logits = engine.model.draft_logits(hidden[p].to(engine.dtype), layers, 3, ids[p + 1])  # [3, B, V]
            block = []
            for depth in range(1, 4):
                target = p + 1 + depth
                noise = position_gumbel_rows(seed, target.tolist(), index)  # [B, V]
                scores = process_logits(logits[depth - 1], windows(target - 1), PAPER).double() + noise
                block.append(scores.argmax(-1) == ids[target])
            hits.append(torch.stack(block, 1).float())
            # the target's own distribution at p + 2 (what layer 1 drafts): its top-1 probability
            logits = engine.model.logits(hidden[p + 1].to(engine.dtype))  # [B, V]
            target = process_logits(logits, windows(p + 1), PAPER)
            peaks.append(torch.softmax(target.double(), -1).amax(-1))  # [B]
        if args.adapt:
            adapter.observe(start, hidden[p].to(engine.dtype), ids[p + 1].tolist())
    hits, peaks = torch.cat(hits), torch.cat(peaks)  # [n, 3], [n]
    inside = draftable[ids[first + 1 : first + 1 + hits.shape[0]]].float()  # x[p + 2] drafted by layer 1
    rows = []
    for low in range(0, hits.shape[0], args.window):
        part = hits[low : low + args.window]
        one, two = part[:, 0], part[:, 0] * part[:, 1]
        rows.append(
            {
                "start": low,
                "positions": part.shape[0],
                "alpha_d1": round(one.mean().item(), 4),
                "alpha_d2": round((two.sum() / one.sum().clamp(min=1)).item(), 4),
                "alpha_d3": round(((two * part[:, 2]).sum() / two.sum().clamp(min=1)).item(), 4),
                "in_draft_vocab": round(inside[low : low + args.window].mean().item(), 4),
                "target_top1": round(peaks[low : low + args.window].mean().item(), 4),
            }
        )
    report = {
        "recording": str(args.recording),
        "adapt": args.adapt,
        "hindsight": args.hindsight,
        "hold_out_odd": args.hold_out_odd,
        "lag": args.lag,
        "settings": vars(settings),
        "windows": rows,
    }
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


def summarize(args: argparse.Namespace) -> None:
    """A markdown row per replay: layer 1 per 2K of output (8 windows of 256; means over positions,
    so a short last window weighs what it holds), the fall from the first 2K to the last, the same
    over the odd windows only (those a --hold-out-odd replay never adapted on), and the windows where
    it beats the first replay given (the committed layers). `--field` summarises another per-window
    value the same way (target_top1: how peaked the text's own distribution is, the same in every
    replay of a recording)."""
    reports = [json.loads(path.read_text()) for path in args.replays]
    field = args.field
    base = [row[field] for row in reports[0]["windows"]]

    def mean(rows: list[dict]) -> float:  # over the rows' positions (the last window can be short)
        return sum(row[field] * row["positions"] for row in rows) / sum(row["positions"] for row in rows)

    for path, report in zip(args.replays, reports):
        rows = report["windows"]
        alpha = [row[field] for row in rows]  # per window
        quarters = [mean(rows[low : low + 8]) for low in range(0, len(rows), 8)]
        odd = rows[1::2]  # 4 in each 2K of an even number of windows
        first, last = mean(odd[:4]), mean(odd[-4:])
        won = sum(a > b for a, b in zip(alpha, base))
        cells = [path.stem, *(f"{q:.3f}" for q in quarters), f"{mean(rows):.3f}"]
        cells += [f"{quarters[-1] - quarters[0]:+.3f}", f"{last - first:+.3f}", f"{won} of {len(alpha)}"]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="generate with AR and keep tokens and hidden states")
    rec.add_argument("--model-dir", type=Path, required=True)
    rec.add_argument("--prompt-file", type=Path, required=True)
    rec.add_argument("--prefix-len", type=int, default=192)
    rec.add_argument("--tokens", type=int, default=8000)
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--out", type=Path, required=True)
    rep = commands.add_parser("replay", help="draft the recording static or adapted, per window")
    rep.add_argument("recording", type=Path)
    rep.add_argument("--model-dir", type=Path, required=True)
    rep.add_argument("--adapt", action="store_true", help="adapt the layers as decoding would")
    rep.add_argument(
        "--hindsight",
        type=int,
        default=0,
        help="adapt over the whole recording this many times first, then measure those layers frozen "
        "(not causal: how well the text can be drafted at each position by layers that saw all of it)",
    )
    rep.add_argument(
        "--hold-out-odd",
        action="store_true",
        help="with --hindsight: adapt on the even windows only, so the odd ones are drafted unseen",
    )
    rep.add_argument(
        "--lag",
        action="store_true",
        help="with --adapt: draft each block with the parameters of a block before, as CUDA's side "
        "stream publishes them (the request's vocabulary stays current)",
    )
    rep.add_argument("--block", type=int, default=16)
    rep.add_argument("--span", type=int, default=AdaptationSettings.span)
    rep.add_argument("--scope", choices=list(SCOPES), default=AdaptationSettings.scope)
    rep.add_argument("--optimizer", choices=list(OPTIMIZERS), default=AdaptationSettings.optimizer)
    rep.add_argument("--vocab", choices=["request", "draft"], default="request")
    rep.add_argument("--lr", type=float, default=None)
    rep.add_argument("--beta2", type=float, default=AdaptationSettings.beta2, help="Adam's beta2")
    rep.add_argument("--steps", type=int, default=1, help="optimiser steps per block")
    rep.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warmup")
    rep.add_argument("--window", type=int, default=256, help="output positions per window")
    rep.add_argument("--out", type=Path, default=None)
    summary = commands.add_parser("summarize", help="markdown rows of replays (the first: the baseline)")
    summary.add_argument("replays", type=Path, nargs="+")
    summary.add_argument(
        "--field",
        choices=["alpha_d1", "alpha_d2", "alpha_d3", "in_draft_vocab", "target_top1"],
        default="alpha_d1",
        help="the per-window value to summarise",
    )
    args = parser.parse_args()
    if args.command == "replay" and args.hold_out_odd and not args.hindsight:
        parser.error("--hold-out-odd holds windows out of the --hindsight passes: give --hindsight N")
    if args.command == "replay" and args.hold_out_odd and args.window % args.block:
        parser.error("--hold-out-odd needs --window to be a multiple of --block: no block straddles windows")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    {"record": record, "replay": replay, "summarize": summarize}[args.command](args)


if __name__ == "__main__":
    main()
