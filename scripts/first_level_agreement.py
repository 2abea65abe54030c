"""How often the target's sample is among draft layer 1's top k candidates, on text the model wrote.

    .venv/bin/python scripts/first_level_agreement.py [--model smollm2-135m] [--heads FILE] [--tokens 1536] \
        [--on book]

Generates `--tokens` with AR steps under the paper's sampling settings (min-p 0.1, θ 1.2, W 256,
seed 1) after the opening of the held-out Pride and Prejudice, then, for every position t past the
penalty window: layer 1 drafts x[t + 2] from the base model's state at t and the root x[t + 1], as
`--tree auto` drafts from the verify pass; the target's sample there is drawn with fresh Gumbel
noise g (argmax of the processed base logits + g), and the draft's candidates are ranked with the
same g (runtime/sampling.draft_ranking). Prints hit@k for k = 1..8: the share of positions whose
target sample is among the first k candidates, i.e. what a first level of k nodes would accept.
`--on book` measures on the book's own text instead (a stretch from its middle, no generation).
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
        drafts = draft_logits(weight, layers, hidden, root_embeddings(engine, layers, ids))[0]  # [T, K]
    columns = vocab_ids(layers, torch.arange(drafts.shape[1]))
    ranks = coupled_ranks(base, drafts, columns, ids, start, PAPER_SAMPLING)
    hits = hit_rates(ranks)
    print(f"{args.model}, {len(ranks)} positions of {args.on} text; hit@1..{WIDTH}: {hits}")


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
) -> list[int]:
    """base [T, V] (row t scores x[t + 1]), drafts [T, K] (row t drafts x[t + 2] over the token ids
    `columns` [K]), ids [T] -> for every t from `start` (at least one penalty window in) the rank of
    the target's sample of x[t + 2] among the draft's first WIDTH candidates (WIDTH: not among them).
    The Gumbel noise is drawn from a fixed seed, so drafts compared on the same ids meet the same
    samples."""
    generator = torch.Generator().manual_seed(0)
    window = sampling.penalty_window
    ranks: list[int] = []
    for t in range(max(start, window), ids.numel() - 2):
        recent = ids[t + 2 - window : t + 2]
        target = process_logits(base[t + 1 : t + 2], recent, sampling)[0]  # what samples x[t + 2]
        full = torch.full_like(target, float("-inf"))
        full[columns] = drafts[t]
        draft = process_logits(full[None], recent, sampling)
        uniform = torch.rand(target.shape[0], generator=generator, dtype=torch.float64).clamp_min(1e-300)
        noise = -torch.log(-torch.log(uniform))
        sample = int(torch.argmax(target.double() + noise))
        candidates = draft_ranking(draft, noise[None], WIDTH)[0].tolist()
        ranks.append(candidates.index(sample) if sample in candidates else WIDTH)
    return ranks


def hit_rates(ranks: list[int]) -> str:
    """'0.285 / 0.401 / ...': the share of ranks below k for k = 1..WIDTH."""
    return " / ".join(f"{sum(rank < k for rank in ranks) / len(ranks):.3f}" for k in range(1, WIDTH + 1))


if __name__ == "__main__":
    main()
