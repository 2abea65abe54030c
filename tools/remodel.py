"""Modeled speedup from measured iteration times, at tokens-per-iteration values a trie can commit
(the GPU check's `model` stage and `python -m tools.remodel_iterations`).

Terms: τ is the number of tokens one TokenSwift iteration commits (accepted drafts + the bonus token).
A static trie of depth d commits at most d + 1 (`trie_cap`). A `bench --random-weights` run measures
the time of an AR step and of an iteration at each prompt length; random weights accept almost
nothing, so the speedup is modeled as τ x AR ms / iteration ms, with τ the cap or a τ measured on a
real model, never above the cap. A generation from the shortest to the longest measured prompt length
is modeled linearly between them (`modeled_long_run`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenswift_trt.bench.compare import modeled_long_run, trie_cap


class RemodelError(ValueError):
    """A bench run that cannot be modeled, or a τ the trie cannot commit (one line, naming the fix)."""


@dataclass(frozen=True)
class Tau:
    label: str
    tau: float
    source: str  # where it comes from: "the trie's cap", "given", a run's path or stage
    measured: float | None = None  # a measured τ before it was capped (None: not capped)


def run_tau(rows: Sequence[dict[str, Any]]) -> float:
    """τ of a real model's `bench` run: per prompt length the longest generation's row (a row holds the
    figures of the whole run up to its length), weighted by generated length across prompt lengths."""
    longest: dict[Any, dict[str, Any]] = {}
    for row in rows:
        key = row.get("prefix_len")
        if key not in longest or row["gen_len"] > longest[key]["gen_len"]:
            longest[key] = row
    if not longest:
        raise RemodelError("the run has no rows: use the bench.json of a finished `bench` run")
    tokens = sum(row["gen_len"] for row in longest.values())
    return round(sum(row["tokens_per_iteration"] * row["gen_len"] for row in longest.values()) / tokens, 3)


def capped(label: str, tau: float, source: str, cap: int) -> Tau:
    """A measured τ, at most the trie's cap (recording the measured value where it was above)."""
    if tau > cap:
        return Tau(label, float(cap), source, measured=tau)
    return Tau(label, tau, source)


def steady_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measured ms per AR token and per iteration at each prompt length of a `bench --random-weights`
    run. With two or more generation lengths per prompt length, the times between the shortest and
    the longest (what those tokens cost on their own: the first tokens' graph captures and warm-up
    left out); AR runs `gen_len - 1` steps after the prompt, TokenSwift `(gen_len - 1) / τ` iterations."""
    if not rows or "ar_decode_ms_per_iteration" not in rows[0]:
        raise RemodelError("the run has no measured iteration times: use a `bench --random-weights` run")
    by_prefix: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_prefix.setdefault(row["prefix_len"], []).append(row)
    steady = []
    for prefix_len, group in sorted(by_prefix.items()):
        group.sort(key=lambda row: row["gen_len"])
        first, last = group[0], group[-1]
        if len(group) == 1:
            ar_ms, iteration_ms = (
                last["ar_decode_ms_per_iteration"],
                last["tokenswift_decode_ms_per_iteration"],
            )
            window = f"0-{last['gen_len']}"
        else:

            def totals(row: dict[str, Any]) -> tuple[float, float, float, float]:
                ar_steps = row["gen_len"] - 1
                iterations = (row["gen_len"] - 1) / row["tokens_per_iteration"]
                return (
                    row["ar_decode_ms_per_iteration"] * ar_steps,
                    ar_steps,
                    row["tokenswift_decode_ms_per_iteration"] * iterations,
                    iterations,
                )

            ar_low, steps_low, swift_low, iterations_low = totals(first)
            ar_high, steps_high, swift_high, iterations_high = totals(last)
            ar_ms = (ar_high - ar_low) / (steps_high - steps_low)
            iteration_ms = (swift_high - swift_low) / max(1e-9, iterations_high - iterations_low)
            window = f"{first['gen_len']}-{last['gen_len']}"
        steady.append(
            {
                "prefix_len": prefix_len,
                "tokens_timed": window,
                "ar_ms_per_token": round(ar_ms, 3),
                "tokenswift_ms_per_iteration": round(iteration_ms, 3),
                "iteration_over_ar_step": round(iteration_ms / ar_ms, 3),
            }
        )
    return steady


def remodel(report: dict[str, Any], taus: Sequence[Tau], steady: bool = False) -> dict[str, Any]:
    """Modeled speedups of a `bench --random-weights` report (its meta and rows) at each τ: per prompt
    length and for the generation from the shortest to each longer one. `steady`: time per token from
    `steady_rows` (else the rows' own `ar_ms_per_token` / `tokenswift_ms_per_iteration`). A τ above the
    trie's cap is refused."""
    meta = report["meta"]
    cap = trie_cap(meta["tree"])
    for tau in taus:
        if tau.tau > cap:
            raise RemodelError(
                f"τ {tau.label} = {tau.tau} is above what tree {meta['tree']} can commit ({cap}); "
                f"use at most {cap}"
            )
    if steady:
        rows = steady_rows(report["rows"])
    else:
        rows = sorted(report["rows"], key=lambda row: row["prefix_len"])
        if not rows or "ar_ms_per_token" not in rows[0]:
            raise RemodelError("the run has no measured iteration times: use a `bench --random-weights` run")
    per_context = [
        {
            "prompt_length": row["prefix_len"],
            "ar_ms_per_token": row["ar_ms_per_token"],
            "iteration_ms": row["tokenswift_ms_per_iteration"],
            "iteration_over_ar_step": row["iteration_over_ar_step"],
            **{
                f"speedup_{tau.label}": round(
                    tau.tau * row["ar_ms_per_token"] / row["tokenswift_ms_per_iteration"], 3
                )
                for tau in taus
            },
        }
        for row in rows
    ]
    long_runs = {
        tau.label: [modeled_long_run(rows[: end + 1], tau.tau) for end in range(1, len(rows))] for tau in taus
    }
    return {
        "tree": meta["tree"],
        "ngram_topk": meta.get("ngram_topk"),
        "trie_cap": cap,
        "taus": [
            {"label": tau.label, "tau": tau.tau, "from": tau.source}
            | ({"measured": tau.measured} if tau.measured is not None else {})
            for tau in taus
        ],
        "per_context": per_context,
        "long_runs": long_runs,
    }


def ar_floor_ms(
    model: str, dtype: str, contexts: Sequence[int], bandwidth_bytes_per_s: float
) -> dict[int, float]:
    """The memory-bandwidth floor of one AR step of `model`'s shape (a preset or model directory) per
    context: the bytes it must read (the weights, plus one embedding row when the head is not tied to
    the table, plus K and V of every cached position) over the measured copy bandwidth, in ms."""
    from pathlib import Path

    import torch

    from tokenswift_trt.builder.build import BuildRequest, resolve
    from tokenswift_trt.model.config import config_from_dict, load_config
    from tokenswift_trt.model.decoder import LlamaModel

    preset, directory = resolve(BuildRequest(model=model, out=Path("."), random_weights=True))
    config = config_from_dict(preset.config) if preset is not None else load_config(directory)
    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    with torch.device("meta"):
        base = LlamaModel(config, device="meta")
    base.tie_weights()
    tied = config.tie_word_embeddings
    table = base.model.embed_tokens.weight.numel()
    weights = (sum(p.numel() for p in base.parameters()) - (0 if tied else table)) * element
    embedding_row = 0 if tied else config.hidden_size * element
    kv_per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element
    return {
        context: round(1e3 * (weights + embedding_row + kv_per_position * context) / bandwidth_bytes_per_s, 3)
        for context in contexts
    }
