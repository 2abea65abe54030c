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
  drafts a chain commits per iteration.

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

from tokenswift_trt.model.draft_layers import DraftLayers
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import SamplingConfig
from tokenswift_trt.training.train_heads import (
    base_hidden,
    base_logits,
    coupled_acceptance,
    draft_logits,
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
) -> ChainPrediction:
    """Score the layers on `sequences` (each ids [T], T > layers + 2) under `sampling`; with `starts`,
    sequence i from its position starts[i] on (the tokens before are context only: a prompt)."""
    layers = len(draft_layers)
    weight = head_weight(engine)
    sampled = not sampling.greedy
    greedy_rows: list[torch.Tensor] = []  # per sequence [layers, R] bool
    sampled_rows: list[torch.Tensor] = []  # per sequence [layers, R] float
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
        greedy, chance = [], []
        for i, logits in enumerate(drafts, start=1):  # layer i at t drafts x[t + 1 + i]
            top = vocab_ids(draft_layers, logits[:rows].argmax(-1))
            greedy.append(top == base_top[i : i + rows])
            if drawn is not None:
                chance.append(coupled_acceptance(draft_layers.vocab, drawn, logits, i, sampling)[:rows])
        greedy_rows.append(torch.stack(greedy)[:, first:])
        if chance:
            sampled_rows.append(torch.stack(chance).float()[:, first:])
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
    )


def measure_chain(
    model: Any, prompts: Sequence[list[int]], new_tokens: int, depth: int, settings: dict[str, Any]
) -> ChainMeasurement:
    """`generate` every prompt with a chain of `depth` layers drafted from the verify pass (tree
    1,1,..., no n-grams) and with AR steps, the same `settings` (sampling, seed); decode time only
    (the prefill excluded)."""
    from tokenswift_trt.api import generate

    tree = ",".join(["1"] * depth)
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
    """The chain's speed over AR from the predicted acceptance and the measured step costs: tokens per
    iteration = 1 + the layers' predicted drafts; seconds per iteration over seconds per AR step as
    measured."""
    drafts = prediction.sampled_drafts_per_iteration if sampled else prediction.greedy_drafts_per_iteration
    tokens = 1 + drafts
    cost = (
        measured.seconds_per_iteration / measured.seconds_per_ar_step if measured.seconds_per_ar_step else 0.0
    )
    return {
        "tokens_per_iteration": tokens,
        "iteration_cost_in_ar_steps": cost,
        "speedup": tokens / cost if cost else 0.0,
        "inputs": "tokens per iteration = 1 + the predicted drafts of the chain; iteration cost measured",
    }


def evaluation_report(
    prediction: ChainPrediction,
    measured: ChainMeasurement | None,
    sampling: SamplingConfig,
    on_measured_text: ChainPrediction | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The figures `eval-heads` writes (JSON). `on_measured_text`: the prediction on the very text the
    measured runs wrote, the like-for-like check of the prediction against `generate`."""
    report: dict[str, Any] = {
        "meta": meta or {},
        "sampling": asdict(sampling),
        "predicted": asdict(prediction),
    }
    if measured is not None:
        figures = asdict(measured)
        figures.pop("texts")
        report["measured"] = figures
        report["modeled"] = modeled_speedup(prediction, measured, not sampling.greedy)
    if on_measured_text is not None:
        report["predicted_on_measured_text"] = asdict(on_measured_text)
    return report
