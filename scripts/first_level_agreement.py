"""How often the target's sample is among draft layer 1's top k candidates, on text the model wrote.

    .venv/bin/python scripts/first_level_agreement.py [--model smollm2-135m] [--heads FILE] [--tokens 1536] \
        [--on book] [--depth 2]

Generates `--tokens` with AR steps under the paper's sampling settings (min-p 0.1, θ 1.2, W 256,
seed 1) after the opening of the held-out Pride and Prejudice, then, for every position t past the
penalty window: layer 1 drafts x[t + 2] from the base model's state at t and the root x[t + 1], as
`--tree auto` drafts from the verify pass; the target's sample there is drawn with fresh Gumbel
noise g (argmax of the processed base logits + g), and the draft's candidates are ranked with the
same g (runtime/sampling.draft_ranking). Prints hit@k for k = 1..8: the share of positions whose
target sample is among the first k candidates, i.e. what a first level of k nodes would accept.
`--on book` measures on the book's own text instead (a stretch from its middle, no generation).
`--depth 2` scores the second level the same way: the chained layer 2's drafts of x[t + 3] and, where
the heads have a path input (runtime/draft_layers.PathInput), the path input's drafts from layer 1's
state and x[t + 2] (the path the target took), over all positions and over those where layer 1's
first 3 candidates held the target's x[t + 2] (where a tree's second level is reached).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tokenswift_trt.cli.common import load_source
from tokenswift_trt.runtime.decoding import GenerationConfig, generate
from tokenswift_trt.runtime.engine import Engine
from tokenswift_trt.runtime.sampling import SamplingConfig, draft_ranking, process_logits
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
HELD_OUT = ROOT.parent / "shared" / "corpus" / "pride_and_prejudice.txt"
WIDTH = 8
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
    first = coupled_ranks(base, drafts[0], columns, ids, start, PAPER_SAMPLING)
    print(f"{args.model}, {len(first)} positions of {args.on} text")
    print(f"layer 1 (x[t + 2]) hit@1..{WIDTH}: {hit_rates(first)}")
    if args.depth == 2:
        reached = [rank < 3 for rank in first]
        for name, rows in [("layer 2", drafts[1])] + [("path input", paths[0])] * bool(paths):
            ranks = coupled_ranks(base, rows, columns, ids, start, PAPER_SAMPLING, depth=2)
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
            max_new_tokens=tokens, method="ar", sampling=PAPER_SAMPLING, seed=1, ignore_eos=True
        )
        new, _ = generate(engine, prompt, config)
    return torch.tensor(prompt + list(new)), len(prompt)


def coupled_ranks(
    base: torch.Tensor,
    drafts: torch.Tensor,
    columns: torch.Tensor,
    ids: torch.Tensor,
    start: int,
    sampling: SamplingConfig,
    depth: int = 1,
) -> list[int]:
    """base [T, V] (row t scores x[t + 1]), drafts [T, K] (row t drafts x[t + 1 + depth] over the
    token ids `columns` [K]), ids [T] -> for every t from `start` (at least one penalty window in,
    the same positions at every depth) the rank of the target's sample of x[t + 1 + depth] among the
    draft's first WIDTH candidates (WIDTH: not among them). The Gumbel noise is drawn from a fixed
    seed, so drafts compared on the same ids meet the same samples."""
    generator = torch.Generator().manual_seed(depth - 1)
    window = sampling.penalty_window
    ranks: list[int] = []
    for t in range(max(start, window), ids.numel() - 3):
        end = t + 1 + depth  # the drafted position
        recent = ids[end - window : end]
        target = process_logits(base[end - 1 : end], recent, sampling)[0]  # what samples x[end]
        full = torch.full_like(target, float("-inf"))
        full[columns] = drafts[t]
        draft = process_logits(full[None], recent, sampling)
        uniform = torch.rand(target.shape[0], generator=generator, dtype=torch.float64).clamp_min(1e-300)
        noise = -torch.log(-torch.log(uniform))
        sample = int(torch.argmax(target.double() + noise))
        candidates = draft_ranking(draft, noise[None], WIDTH)[0].tolist()
        ranks.append(candidates.index(sample) if sample in candidates else WIDTH)
    return ranks


def hit_rates(ranks: list[int], where: list[bool] | None = None) -> str:
    """'0.285 / 0.401 / ...': the share of ranks below k for k = 1..WIDTH (of the ranks `where` is
    True for, when given)."""
    if where is not None:
        ranks = [rank for rank, keep in zip(ranks, where, strict=True) if keep]
    return " / ".join(f"{sum(rank < k for rank in ranks) / len(ranks):.3f}" for k in range(1, WIDTH + 1))


if __name__ == "__main__":
    main()
