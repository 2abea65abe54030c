"""How good draft layers are, in the terms that decide speed (`eval-heads`).

On held-out token sequences (best: text the model wrote itself, `train-data` on prompts it was not
trained on), teacher-forced at every position t:
- per layer i, greedy acceptance: its top-1 for x[t + 1 + i] is the base model's top-1 there (what
  greedy verification accepts), and sampled acceptance: the chance that its first draft is the token
  sampling draws, both ranked with the same noise after the penalty and min-p (`coupled_hit`: what
  coupled verification accepts);
- per depth d of a chain of the layers, the chance that depths 1..d are all accepted at the same t,
  and so the acceptance of depth d given the depths before it (what `generate --json` reports as
  `acceptance_by_depth` for a chain drafted from the verify pass, as `--tree auto` drafts) and the
  drafts a chain commits per iteration;
- per candidate tree of `--tree auto` drafting from the verify pass (depth d: draft layer d's top
  candidates, ranked as sampling ranks them; no n-grams), the tokens it would commit per iteration:
  1 + the mean over positions of the depths whose target is among that depth's candidates, all the
  depths before it too. Greedy from the target's rank in each layer's logits; sampled from `draws`
  Gumbel draws per position (the target's sample and the draft's ranking under the same noise).

`measure_chain` then runs `generate` on held-out prompts with the layers' chain (`--tree 1,1,1
--draft-source verify`, no n-grams) and with AR steps: the acceptance by depth it measured, the
tokens per iteration, the seconds per iteration and per AR step on this machine. From those step
costs and the predicted acceptance, `modeled_speedup` is the speed the layers would give; the
measured one stands beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tokenswift_trt.decode.tree import TreeSpec, build_static_tree
from tokenswift_trt.decode.tuner_costs import CANDIDATE_TREES, interpolate, time_verify, tree_text
from tokenswift_trt.model.draft_layers import DraftLayers
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig
from tokenswift_trt.training.train_heads import (
    base_hidden,
    base_logits,
    coupled_acceptance,
    draft_logits,
    drafted_rows,
    head_weight,
    root_embeddings,
    sampled_teacher,
    vocab_ids,
)


@dataclass
class ChainPrediction:
    """Teacher-forced figures of the layers on held-out sequences (see the module docstring)."""

    positions: int  # scored positions
    greedy_acceptance: list[float]  # per layer
    sampled_acceptance: list[float]  # per layer; empty when the sampling is greedy
    greedy_by_depth: list[float]  # per chain depth, given the depths before it
    sampled_by_depth: list[float]
    greedy_drafts_per_iteration: float  # accepted drafts of a chain of all the layers
    sampled_drafts_per_iteration: float
    # per candidate tree: {"tree", "nodes", "greedy_tokens_per_iteration", "sampled_tokens_per_iteration"}
    trees: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ChainMeasurement:
    """`generate` with the layers' chain and with AR steps on held-out prompts, on this machine."""

    tree: str
    new_tokens: int
    acceptance_by_depth: list[float]  # as generate --json reports it: depth 1 is the base's own draft
    tokens_per_iteration: float
    seconds_per_iteration: float
    seconds_per_ar_step: float
    speedup: float  # the chain's decode tokens/s over AR's
    runs: list[dict[str, Any]] = field(default_factory=list)
    texts: list[list[int]] = field(default_factory=list)  # each run's prompt + output token ids


MAX_RANK = 4  # ranks are kept up to here: the candidate trees are at most 3 wide
DRAWS = 8  # Gumbel draws per position for the sampled ranks
CHUNK = 128  # rows per draw at a time ([CHUNK, vocab] noise)


def _greedy_ranks(vocab: torch.Tensor | None, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """logits [R, K] over the draft vocabulary `vocab` (sorted ids; None: the whole vocabulary), target
    [R] token ids -> [R] the target's rank among the logits (0: the top), MAX_RANK where it is lower or
    outside the draft vocabulary."""
    if vocab is None:
        index, inside = target, torch.ones_like(target, dtype=torch.bool)
    else:
        sorted_ids = vocab.to(target.device)
        index = torch.searchsorted(sorted_ids, target).clamp_max(sorted_ids.numel() - 1)
        inside = sorted_ids[index] == target
    score = logits.gather(-1, index[:, None])
    rank = (logits > score).sum(-1)
    return torch.where(inside, rank, MAX_RANK).clamp_max(MAX_RANK)


def _sampled_ranks(
    vocab: torch.Tensor | None,
    drawn: tuple[torch.Tensor, torch.Tensor | None],
    logits: torch.Tensor,
    layer: int,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> torch.Tensor:
    """-> [DRAWS, T - 1 - layer] per Gumbel draw the rank of the target's sample (argmax of log p + g)
    in layer `layer`'s ranking under the same noise (log q + g), clamped to MAX_RANK; row t drafts
    x[t + 1 + layer] (`coupled_acceptance`'s rows)."""
    log_p = drawn[0][layer:-1].float().log()  # [R, V], -inf where sampling cannot draw
    log_q = drafted_rows(vocab, drawn, logits, layer, sampling).log_softmax(-1)  # [R, V]
    ranks = torch.empty(DRAWS, log_p.shape[0], dtype=torch.long, device=log_p.device)
    for draw in range(DRAWS):
        for start in range(0, log_p.shape[0], CHUNK):
            rows = slice(start, start + CHUNK)
            uniform = torch.rand(log_p[rows].shape, generator=generator, device=log_p.device)
            noise = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
            target = (log_p[rows] + noise).argmax(-1, keepdim=True)
            score = log_q[rows] + noise
            ranks[draw, rows] = (score > score.gather(-1, target)).sum(-1)
    return ranks.clamp_max(MAX_RANK)


def tokens_key(sampled: bool) -> str:
    """The key of a tree's tokens per iteration (`ChainPrediction.trees`) under that sampling."""
    return "sampled_tokens_per_iteration" if sampled else "greedy_tokens_per_iteration"


def tree_figures(
    greedy: torch.Tensor, sampled: torch.Tensor | None, extra: Sequence[TreeSpec] = ()
) -> list[dict[str, Any]]:
    """greedy [layers, P] ranks, sampled [draws, layers, P] or None -> per candidate tree (and each of
    `extra`) of at most `layers` depths its nodes and tokens per iteration (see the module docstring)."""
    found = []
    for tree in dict.fromkeys([*CANDIDATE_TREES, *extra]):
        widths = tree.branching
        if len(widths) > greedy.shape[0]:
            continue
        depth, limit = len(widths), torch.tensor(widths, device=greedy.device)[:, None]
        nodes = build_static_tree(widths).num_nodes - 1  # the root not counted
        joint = torch.cumprod((greedy[:depth] < limit).double(), dim=0)  # [depth, P]
        figures: dict[str, Any] = {
            "tree": tree_text(tree),
            "nodes": nodes,
            "greedy_tokens_per_iteration": 1 + joint.sum(0).mean().item(),
            "sampled_tokens_per_iteration": None,
        }
        if sampled is not None:
            joint = torch.cumprod((sampled[:, :depth] < limit).double(), dim=1)  # [draws, depth, P]
            figures["sampled_tokens_per_iteration"] = 1 + joint.sum(1).mean().item()
        found.append(figures)
    return found


def _by_depth(joint: list[float]) -> list[float]:
    """P(depth d accepted | depths before accepted) from P(depths 1..d all accepted)."""
    before = [1.0, *joint[:-1]]
    return [j / b if b else 0.0 for j, b in zip(joint, before)]


@torch.no_grad()
def predict_chain(
    engine: Engine,
    draft_layers: DraftLayers,
    sequences: Sequence[torch.Tensor],
    sampling: SamplingConfig,
    starts: Sequence[int] | None = None,
    trees: Sequence[TreeSpec] = (),
) -> ChainPrediction:
    """Score the layers on `sequences` (each ids [T], T > layers + 2) under `sampling`; with `starts`,
    sequence i from its position starts[i] on (the tokens before are context only: a prompt). `trees`:
    trees (at most MAX_RANK wide) to score besides the tuner's candidates."""
    layers = len(draft_layers)
    weight = head_weight(engine)
    sampled = not sampling.greedy
    greedy_rows: list[torch.Tensor] = []  # per sequence [layers, R] bool
    sampled_rows: list[torch.Tensor] = []  # per sequence [layers, R] float
    greedy_ranks: list[torch.Tensor] = []  # per sequence [layers, R] long
    sampled_ranks: list[torch.Tensor] = []  # per sequence [draws, layers, R] long
    generator: torch.Generator | None = None
    for index, ids in enumerate(sequences):
        rows = ids.numel() - 1 - layers  # positions t where every layer's target exists
        first = 0 if starts is None else max(0, starts[index] - 1)  # row t drafts from x[t]'s state
        if rows - first <= 0:
            continue
        hidden = base_hidden(engine, ids)
        base = base_logits(engine, weight, hidden)  # [T, V]: row t is the base's x[t + 1]
        base_top = base.argmax(-1)
        drafts = draft_logits(weight, draft_layers, hidden, root_embeddings(engine, draft_layers, ids))
        drawn = sampled_teacher(base, ids, None, sampling) if sampled else None
        greedy, chance, ranks, noisy = [], [], [], []
        for i, logits in enumerate(drafts, start=1):  # layer i at t drafts x[t + 1 + i]
            top = vocab_ids(draft_layers, logits[:rows].argmax(-1))
            greedy.append(top == base_top[i : i + rows])
            ranks.append(_greedy_ranks(draft_layers.vocab, logits[:rows], base_top[i : i + rows]))
            if drawn is not None:
                chance.append(coupled_acceptance(draft_layers.vocab, drawn, logits, i, sampling)[:rows])
                if generator is None:
                    generator = torch.Generator(device=logits.device).manual_seed(0)
                noisy.append(
                    _sampled_ranks(draft_layers.vocab, drawn, logits, i, sampling, generator)[:, :rows]
                )
        greedy_rows.append(torch.stack(greedy)[:, first:])
        greedy_ranks.append(torch.stack(ranks)[:, first:])
        if chance:
            sampled_rows.append(torch.stack(chance).float()[:, first:])
            sampled_ranks.append(torch.stack(noisy, dim=1)[:, :, first:])
    if not greedy_rows:
        raise ValueError(f"held-out sequences must be longer than {layers + 1} tokens")
    hits = torch.cat(greedy_rows, dim=1).float()  # [layers, positions]
    greedy_joint = torch.cumprod(hits, dim=0).mean(dim=1).tolist()  # depths 1..d all accepted
    positions = hits.shape[1]
    if sampled_rows:
        chances = torch.cat(sampled_rows, dim=1).double()  # per position independent draws per layer
        sampled_each = chances.mean(dim=1).tolist()
        sampled_joint = torch.cumprod(chances, dim=0).mean(dim=1).tolist()
    else:
        sampled_each, sampled_joint = [], []
    return ChainPrediction(
        positions,
        hits.mean(dim=1).tolist(),
        sampled_each,
        _by_depth(greedy_joint),
        _by_depth(sampled_joint),
        sum(greedy_joint),
        sum(sampled_joint),
        tree_figures(
            torch.cat(greedy_ranks, dim=1), torch.cat(sampled_ranks, dim=2) if sampled_ranks else None, trees
        ),
    )


def measure_chain(
    model: Any,
    prompts: Sequence[list[int]],
    new_tokens: int,
    depth: int,
    settings: dict[str, Any],
    tree: str | None = None,
) -> ChainMeasurement:
    """`generate` every prompt with a chain of `depth` layers drafted from the verify pass (tree
    1,1,..., or `tree`; no n-grams) and with AR steps, the same `settings` (sampling, seed); decode
    time only (the prefill excluded)."""
    from tokenswift_trt.api import generate

    tree = tree or ",".join(["1"] * depth)
    depth = len(tree.split(","))
    reached = [0] * depth
    accepted = [0] * depth
    iterations = tokens = 0
    chain_s = ar_s = 0.0
    ar_steps = 0
    runs, texts = [], []
    for index, prompt in enumerate(prompts):
        run = {**settings, "ignore_eos": True, "seed": settings.get("seed", 0) + index}
        result = generate(model, prompt, new_tokens, tree=tree, ngram_topk=0, draft_source="verify", **run)
        chain, ar = result.stats, generate(model, prompt, new_tokens, method="ar", **run).stats
        texts.append(list(prompt) + list(result.token_ids))
        assert chain is not None and ar is not None
        for d, (r, a) in enumerate(zip(chain.reached_by_depth, chain.accepted_by_depth)):
            reached[d] += r
            accepted[d] += a
        iterations += chain.iterations
        tokens += chain.new_tokens - 1  # the first token comes from the prefill
        chain_s += chain.elapsed_s - chain.prefill_s
        ar_s += ar.elapsed_s - ar.prefill_s
        ar_steps += ar.iterations
        runs.append({"chain": _run_figures(chain), "ar": _run_figures(ar)})
    per_iteration = chain_s / iterations if iterations else 0.0
    per_step = ar_s / ar_steps if ar_steps else 0.0
    return ChainMeasurement(
        tree,
        new_tokens,
        [a / r if r else 0.0 for a, r in zip(accepted, reached)],
        tokens / iterations if iterations else 0.0,
        per_iteration,
        per_step,
        (ar_s / chain_s) if chain_s else 0.0,
        runs,
        texts,
    )


def _run_figures(stats: Any) -> dict[str, Any]:
    return {
        "new_tokens": stats.new_tokens,
        "iterations": stats.iterations,
        "decode_s": stats.elapsed_s - stats.prefill_s,
        "acceptance_by_depth": stats.acceptance_by_depth,
    }


def modeled_speedup(prediction: ChainPrediction, measured: ChainMeasurement, sampled: bool) -> dict[str, Any]:
    """The measured tree's speed over AR from the predicted acceptance and the measured step costs:
    tokens per iteration as predicted for that tree (for the chain of every layer, 1 + the layers'
    predicted drafts); seconds per iteration over seconds per AR step as measured."""
    key = tokens_key(sampled)
    scored = {figures["tree"]: figures[key] for figures in prediction.trees}
    drafts = prediction.sampled_drafts_per_iteration if sampled else prediction.greedy_drafts_per_iteration
    chain = ",".join(["1"] * len(prediction.greedy_acceptance))  # the exact coupled figure, not the draws'
    tokens = 1 + drafts if measured.tree == chain else scored[measured.tree]
    cost = (
        measured.seconds_per_iteration / measured.seconds_per_ar_step if measured.seconds_per_ar_step else 0.0
    )
    return {
        "tokens_per_iteration": tokens,
        "iteration_cost_in_ar_steps": cost,
        "speedup": tokens / cost if cost else 0.0,
        "inputs": f"tokens per iteration as predicted for tree {measured.tree}; iteration cost measured",
    }


@torch.inference_mode()
def measure_verify_costs(engine: Engine, context: Sequence[int], sizes: Sequence[int]) -> dict[int, float]:
    """Seconds of one forward of `size` new tokens after `context` (prefilled once) for each size, timed
    in turns (`time_verify`): what a verify of that many rows costs at this context on this machine."""
    c = engine.config
    largest = max(sizes)
    cache = KVCache(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        len(context) + largest,
        engine.dtype,
        engine.device,
        engine.kernels,
    )
    ids = torch.tensor(list(context), dtype=torch.long, device=engine.device)
    engine.model(ids, torch.arange(len(context), device=engine.device), cache)
    cache.commit()

    def forward(size: int) -> None:
        tokens = ids[-1:].expand(size).contiguous()
        positions = torch.arange(len(context), len(context) + size, device=engine.device)
        engine.model(tokens, positions, cache)
        cache.pending = 0  # timing only: nothing written is kept

    return time_verify(forward, sorted(set(sizes)), repeats=3)


def modeled_trees(
    prediction: ChainPrediction, measured: Sequence[ChainMeasurement], costs: dict[int, float], sampled: bool
) -> list[dict[str, Any]]:
    """Each candidate tree's speed over AR steps, modeled: its predicted tokens per iteration over its
    iteration's cost, in AR steps as measured. The cost is the tree's verify forward (`costs`, by rows:
    the tree's nodes + the root) plus the rest of an iteration (drafting, sampling, acceptance), taken
    from the measured trees: their iteration less their verify forward, linear in the tree's nodes
    between and beyond two measured trees, the same for every tree with one (which leaves out what
    more nodes cost outside the forward: an optimistic cost for trees larger than the measured one).
    Fastest first."""
    ar_step = sum(m.seconds_per_ar_step for m in measured) / len(measured)
    rest = {}  # nodes -> seconds of an iteration outside its verify forward
    for m in measured:
        nodes = build_static_tree(m.tree).num_nodes - 1
        rest[nodes] = m.seconds_per_iteration - costs[nodes + 1]
    key = tokens_key(sampled)
    found = []
    for figures in prediction.trees:
        nodes = figures["nodes"]
        outside = interpolate(rest, nodes) if len(rest) > 1 else next(iter(rest.values()))
        # never below zero: under load a run's iteration can time shorter than its verify timed apart
        outside = max(0.0, outside)
        cost = (outside + costs[nodes + 1]) / ar_step if ar_step else 0.0
        tokens = figures[key]
        found.append(
            {
                "tree": figures["tree"],
                "tokens_per_iteration": tokens,
                "iteration_cost_in_ar_steps": round(cost, 4),
                "speedup": round(tokens / cost, 4) if cost > 0 else 0.0,
            }
        )
    return sorted(found, key=lambda row: -row["speedup"])


def evaluation_report(
    prediction: ChainPrediction,
    measured: Sequence[ChainMeasurement],
    sampling: SamplingConfig,
    on_measured_text: Sequence[ChainPrediction] = (),
    meta: dict[str, Any] | None = None,
    verify_costs: dict[int, float] | None = None,
) -> dict[str, Any]:
    """The figures `eval-heads` writes (JSON): `measured` the trees `generate` ran (the first as
    "measured", all under "measured_trees"); `on_measured_text` the prediction on the very text each
    measured run wrote, the like-for-like check of the prediction against `generate`; `verify_costs`
    `measure_verify_costs` at every tree's size, for the trees' modeled speed (`modeled_trees`)."""
    report: dict[str, Any] = {
        "meta": meta or {},
        "sampling": asdict(sampling),
        "predicted": asdict(prediction),
    }
    key = tokens_key(not sampling.greedy)
    if measured:
        figures = asdict(measured[0])
        figures.pop("texts")
        report["measured"] = figures
        report["measured_trees"] = [
            {
                "tree": m.tree,
                "tokens_per_iteration": m.tokens_per_iteration,
                "predicted_on_its_text": next(t[key] for t in same.trees if t["tree"] == m.tree),
                "seconds_per_iteration": m.seconds_per_iteration,
                "seconds_per_ar_step": m.seconds_per_ar_step,
                "speedup": m.speedup,
            }
            for m, same in zip(measured, on_measured_text, strict=True)
        ]
        report["modeled"] = modeled_speedup(prediction, measured[0], not sampling.greedy)
        if verify_costs is not None:
            report["modeled"]["trees"] = modeled_trees(
                prediction, measured, verify_costs, not sampling.greedy
            )
            report["modeled"]["verify_seconds_by_rows"] = verify_costs
    if on_measured_text:
        report["predicted_on_measured_text"] = asdict(on_measured_text[0])
    return report
