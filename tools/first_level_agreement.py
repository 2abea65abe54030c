"""How often the target's sample is among draft layer 1's top k candidates, on text the model wrote.

    .venv/bin/python -m tools.first_level_agreement [--model smollm2-135m] [--heads FILE] [--tokens 1536] \
        [--on book] [--depth 2]

Generates `--tokens` with AR steps under the paper's sampling settings (min-p 0.1, θ 1.2, W 256,
seed 1) after the opening of the held-out Pride and Prejudice, then, for every position t past the
penalty window: layer 1 drafts x[t + 2] from the base model's state at t and the root x[t + 1], as
`--tree auto` drafts from the verify pass; the target's sample there is drawn with fresh Gumbel
noise g (argmax of the processed base logits + g), and the draft's candidates are ranked with the
same g (model/sampling.draft_ranking). Prints hit@k for k = 1..8: the share of positions whose
target sample is among the first k candidates, i.e. what a first level of k nodes would accept.
`--on book` measures on the book's own text instead (a stretch from its middle, no generation).
`--depth 2` scores the second level the same way: the chained layer 2's drafts of x[t + 3] and, where
the heads have a path input (model/draft_layers.PathInput), the path input's drafts from layer 1's
state and x[t + 2] (the path the target took), over all positions and over those where layer 1's
first 3 candidates held the target's x[t + 2] (where a tree's second level is reached).

`--by-confidence` asks whether the draft knows, before verifying, which tree shape will pay (what a tree
shaped per iteration would use): positions are split into fifths by the draft's own confidence, the gap
between layer 1's first and second candidates' perturbed scores; each fifth prints how often the
target's sample was the first, second and third candidate, and the tokens per iteration that trees
`1`, `2`, `3`, `1,1` and `2,1` would commit there (layer 2 drafting depth 2). On generated text these
use the noise that generated it (seed 1, position by position, as decoding does), so depth 2 is scored
on the token the target really drew at depth 1. `--ngram` asks what TokenSwift's n-gram reuse would add
here: how often the token after the last earlier occurrence of the n tokens ending at the root
(n = 1..3) is the target's sample, over all positions and over those where layer 1's first 3
candidates missed it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenswift_trt.cli.common import load_source
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import SamplingConfig, draft_ranking, position_gumbel, process_logits
from tokenswift_trt.training.train_heads import (
    base_hidden,
    base_logits,
    draft_logits,
    head_weight,
    path_logits,
    root_embeddings,
    vocab_ids,
)

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT / "data" / "corpus" / "pride_and_prejudice.txt"  # unpacked by `make corpus`
WIDTH = 8
SEED = 1  # the generated text's sampling seed
SHAPES = ("1", "2", "3", "1,1", "2,1")  # trees the confidence table scores
PAPER_SAMPLING = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--heads", type=Path, default=None, help="draft layers (default: the preset's)")
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--prompt-file", type=Path, default=HELD_OUT)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--on", choices=("generated", "book"), default="generated")
    parser.add_argument("--depth", type=int, choices=(1, 2), default=1)
    parser.add_argument("--by-confidence", action="store_true", help="hits by the draft's confidence")
    parser.add_argument("--ngram", action="store_true", help="what n-gram continuations would add")
    args = parser.parse_args()
    source = load_source(args.model, None, None, args.heads, None, "cpu", True)
    engine, layers = source.engine, source.engine.draft_layers
    if layers is None or not layers.root_conditioned:
        raise SystemExit(f"{args.model} has no root-conditioned draft layers")
    text = source.codec.encode(args.prompt_file.read_text())
    ids, start = evaluation_text(engine, text, args.on, args.prefix_len, args.tokens)
    weight = head_weight(engine)
    with torch.no_grad():
        hidden = base_hidden(engine, ids)
        base = base_logits(engine, weight, hidden)  # [T, V]: row t scores x[t + 1]
        roots = root_embeddings(engine, layers, ids)
        drafts = draft_logits(weight, layers, hidden, roots)  # per layer [T, K]
        paths = []
        if layers.path is not None and args.depth == 2:
            paths = path_logits(engine, weight, layers, layers.chain(hidden, 1, roots)[0][0], ids)
    columns = vocab_ids(layers, torch.arange(drafts[0].shape[1]))
    draws = coupled_draws(base, drafts[0], columns, ids, start, PAPER_SAMPLING)
    first = [draw.rank for draw in draws]
    print(f"{args.model}, {len(first)} positions of {args.on} text")
    print(f"layer 1 (x[t + 2]) hit@1..{WIDTH}: {hit_rates(first)}")
    if args.by_confidence:
        if len(drafts) < 2:
            raise SystemExit("--by-confidence scores depth 2 too: these heads have one draft layer")
        seed = SEED if args.on == "generated" else None
        first_level = coupled_draws(base, drafts[0], columns, ids, start, PAPER_SAMPLING, 1, seed)
        second_level = coupled_draws(base, drafts[1], columns, ids, start, PAPER_SAMPLING, 2, seed)
        print(confidence_table(first_level, second_level))
    if args.ngram:
        print(ngram_table(draws, ids.tolist(), first_position(start, PAPER_SAMPLING)))
    if args.depth == 2:
        reached = [rank < 3 for rank in first]
        for name, rows in [("layer 2", drafts[1])] + ([("path input", paths[0])] if paths else []):
            ranks = [draw.rank for draw in coupled_draws(base, rows, columns, ids, start, PAPER_SAMPLING, 2)]
            print(f"{name} (x[t + 3]) hit@1..{WIDTH}: {hit_rates(ranks)}")
            print(f"  where layer 1's top 3 held x[t + 2]: {hit_rates(ranks, reached)}")


def evaluation_text(
    engine: Engine, text: list[int], on: str, prefix_len: int, tokens: int
) -> tuple[torch.Tensor, int]:
    """-> (ids [T], start): the book's opening and `tokens` the model generates after it with AR
    steps under the paper's sampling (seed 1), or (`on` == "book") a stretch from the book's middle;
    `start` is where the scored text begins."""
    if on == "book":
        middle = len(text) // 2
        prompt, new = text[middle : middle + prefix_len], text[middle + prefix_len :][:tokens]
    else:
        prompt = text[:prefix_len]
        config = GenerationConfig(
            max_new_tokens=tokens, method="ar", sampling=PAPER_SAMPLING, seed=SEED, ignore_eos=True
        )
        new, _ = generate(engine, prompt, config)
    return torch.tensor(prompt + list(new)), len(prompt)


@dataclass
class Draw:
    """One scored position: the target's coupled sample, its rank among the draft's first WIDTH
    candidates (WIDTH: not among them) and the draft's confidence (its first candidate's perturbed
    score less its second's)."""

    sample: int
    rank: int
    gap: float


def first_position(start: int, sampling: SamplingConfig) -> int:
    """The first t scored: at least one penalty window into the text."""
    return max(start, sampling.penalty_window)


def coupled_draws(
    base: torch.Tensor,
    drafts: torch.Tensor,
    columns: torch.Tensor,
    ids: torch.Tensor,
    start: int,
    sampling: SamplingConfig,
    depth: int = 1,
    noise_seed: int | None = None,
) -> list[Draw]:
    """base [T, V] (row t scores x[t + 1]), drafts [T, K] (row t drafts x[t + 1 + depth] over the
    token ids `columns` [K]), ids [T] -> for every t from `first_position` (the same positions at
    every depth) the target's sample of x[t + 1 + depth] and where the draft ranked it. The Gumbel
    noise is drawn from a fixed seed, so drafts compared on the same ids meet the same samples; with
    `noise_seed` it is decoding's own noise of each position instead (`position_gumbel`), under which
    the sample of text generated with that seed is the text's own token."""
    generator = torch.Generator().manual_seed(depth - 1)
    window = sampling.penalty_window
    draws: list[Draw] = []
    for t in range(first_position(start, sampling), ids.numel() - 3):
        end = t + 1 + depth  # the drafted position
        recent = ids[end - window : end]
        target = process_logits(base[end - 1 : end], recent, sampling)[0]  # what samples x[end]
        full = torch.full_like(target, float("-inf"))
        full[columns] = drafts[t]
        draft = process_logits(full[None], recent, sampling)
        if noise_seed is None:
            uniform = torch.rand(target.shape[0], generator=generator, dtype=torch.float64).clamp_min(1e-300)
            noise = -torch.log(-torch.log(uniform))
        else:
            noise = position_gumbel(noise_seed, end, target.shape[0])
        sample = int(torch.argmax(target.double() + noise))
        candidates = draft_ranking(draft, noise[None], WIDTH)[0].tolist()
        perturbed = draft[0, candidates[:2]].double() + noise[candidates[:2]]
        draws.append(
            Draw(
                sample=sample,
                rank=candidates.index(sample) if sample in candidates else WIDTH,
                gap=float(perturbed[0] - perturbed[1]),
            )
        )
    return draws


def confidence_table(first: list[Draw], second: list[Draw], parts: int = 5) -> str:
    """Markdown: positions in `parts` equal shares by layer 1's gap, lowest first -> how often the
    target's sample was layer 1's first, second, third candidate, and the tokens per iteration of
    each of SHAPES there (`second`: layer 2's draws of the next position, same positions)."""

    def committed(shape: str, one: Draw, two: Draw) -> int:
        widths = [int(width) for width in shape.split(",")]
        if one.rank >= widths[0]:
            return 1
        # as decode/tree.py builds it: every first-level node has widths[1] children, and without a
        # path input layer 2 drafts the same children under each
        return 2 + (len(widths) > 1 and two.rank < widths[1])

    order = sorted(range(len(first)), key=lambda i: first[i].gap)
    shapes = " | ".join(f"`{shape}`" for shape in SHAPES)
    lines = [f"| layer 1's gap | 1st candidate | 2nd | 3rd | {shapes} |", "|" + "---|" * (4 + len(SHAPES))]
    for part in range(parts):
        share = order[part * len(order) // parts : (part + 1) * len(order) // parts]
        hits = [sum(first[i].rank == k for i in share) / len(share) for k in range(3)]
        tokens = [sum(committed(shape, first[i], second[i]) for i in share) / len(share) for shape in SHAPES]
        lines.append(
            f"| {first[share[0]].gap:.2f}-{first[share[-1]].gap:.2f} | "
            + " | ".join(f"{value:.3f}" for value in hits + tokens)
            + " |"
        )
    return "\n".join(lines)


def ngram_table(draws: list[Draw], ids: list[int], first: int) -> str:
    """Markdown: for n = 1..3, how often the n tokens ending at the root occurred before, how often
    the token after their last occurrence is the target's sample (over all positions, and over those
    where the draft's first 3 candidates missed it: what an n-gram branch would add to tree `3`)."""
    lines = [
        "| n | occurred before | continuation right | right where top 3 missed (of all positions) |",
        "|---|---|---|---|",
    ]
    for n in (1, 2, 3):
        occurred = right = added = 0
        for offset, draw in enumerate(draws):
            root = first + offset + 1  # x[t + 1]; the draft's position is t + 2
            key = ids[root + 1 - n : root + 1]
            follower = next((ids[s + n] for s in range(root - n, -1, -1) if ids[s : s + n] == key), None)
            if follower is None:
                continue
            occurred += 1
            right += follower == draw.sample
            added += follower == draw.sample and draw.rank >= 3
        shares = (occurred / len(draws), right / max(occurred, 1), added / len(draws))
        lines.append(f"| {n} | " + " | ".join(f"{share:.3f}" for share in shares) + " |")
    return "\n".join(lines)


def hit_rates(ranks: list[int], where: list[bool] | None = None) -> str:
    """'0.285 / 0.401 / ...': the share of ranks below k for k = 1..WIDTH (of the ranks `where` is
    True for, when given)."""
    if where is not None:
        ranks = [rank for rank, keep in zip(ranks, where, strict=True) if keep]
    return " / ".join(f"{sum(rank < k for rank in ranks) / len(ranks):.3f}" for k in range(1, WIDTH + 1))


if __name__ == "__main__":
    main()
