"""`bench` as library calls: AR against TokenSwift in whole generations on one engine, the rows of
figures, and the report (bench.csv, bench.json, bench_windows.csv). With random weights
(`random_weights_engine`), a model shape timed with no checkpoint or text: the measured times per AR
token and per iteration, and the speedup they give at an assumed tokens-per-iteration.

    spec = BenchSpec(gen_lens=(2048,), prefix_lens=(512,), prompts=1, repeats=1, config=config)
    rows = run_comparison(engine, text_ids, spec, progress)      # measured
    outcome = write_comparison(engine, rows, BenchJob(spec, out=Path("runs/bench")))

The CLI's `bench` is these calls plus printing (under `--tp`, rank 0 alone writes the report).
Every failure is a `BenchError` (or another `ValueError`) whose first line names what to change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.decode.tree import TreeSpec
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.engine import Engine

from .run import BenchSpec, run_bench, write_results
from .steps import random_engine

# the columns printed per row, in order (those a run has)
COLUMNS = (
    "prefix_len",
    "gen_len",
    "ar_tokens_per_s",
    "tokenswift_tokens_per_s",
    "speedup",
    "alpha",
    "beta",
    "tokens_per_iteration",
    "tokens_per_forward",
    "distinct4_penalty",
    "distinct4_no_penalty",
    "tokens_equal_ar",
    "adapted_tokens_per_s",
    "adapted_alpha",
    "adapted_tokens_per_iteration",
    "adapted_tokens_equal_ar",
)
# with random weights acceptance means nothing: what the measured times imply at the accept length
RANDOM_WEIGHTS_COLUMNS = (
    "prefix_len",
    "gen_len",
    "ar_ms_per_token",
    "tokenswift_ms_per_iteration",
    "iteration_over_ar_step",
    "tokens_per_iteration",
    "modeled_speedup",
    "tokens_equal_ar",
)


def trie_cap(tree: TreeSpec | str) -> int:
    """Most tokens one iteration of a static tree commits (τ at its highest): every level accepted, plus
    the bonus token."""
    return len(TreeSpec.parse(tree).branching) + 1


def measured_iteration_times(row: dict, accept_length: float) -> dict:
    """A bench row's measured decode times per AR token and per TokenSwift iteration (ms, the prompt's
    prefill left out), the iteration in AR steps, and the speedup an iteration of that cost gives when
    it commits `accept_length` tokens."""
    ar_ms = row["ar_decode_ms_per_iteration"]
    iteration_ms = row["tokenswift_decode_ms_per_iteration"]
    return {
        "ar_ms_per_token": round(ar_ms, 3),
        "tokenswift_ms_per_iteration": round(iteration_ms, 3),
        "iteration_over_ar_step": round(iteration_ms / ar_ms, 3),
        "modeled_speedup": round(accept_length * ar_ms / iteration_ms, 3),
    }


def modeled_long_run(rows: list[dict], accept_length: float) -> dict | None:
    """A generation from the shortest measured prompt to the longest, modeled from the rows' measured
    times at each prompt length (linear between them): each new token costs AR one step at its context,
    and TokenSwift 1 / `accept_length` of an iteration there. None with fewer than two prompt lengths."""
    by_context = sorted({row["prefix_len"]: row for row in rows}.items())
    if len(by_context) < 2:
        return None
    ar_s = tokenswift_s = 0.0
    for (start, low), (end, high) in zip(by_context, by_context[1:]):
        tokens = end - start  # the mean of a linear cost over the span: the mean of its ends
        ar_s += tokens * (low["ar_ms_per_token"] + high["ar_ms_per_token"]) / 2e3
        iteration = (low["tokenswift_ms_per_iteration"] + high["tokenswift_ms_per_iteration"]) / 2e3
        tokenswift_s += tokens * iteration / accept_length
    return {
        "from_context": by_context[0][0],
        "to_context": by_context[-1][0],
        "tokens": by_context[-1][0] - by_context[0][0],
        "ar_s": round(ar_s, 2),
        "tokenswift_s": round(tokenswift_s, 2),
        "modeled_speedup": round(ar_s / tokenswift_s, 3),
    }


class BenchError(ValueError):
    """The bench cannot run as asked (the message names the flag or figure to change)."""


def check_counts(prompts: int, repeats: int, interleave: int, window: int) -> None:
    """One-line errors for counts the bench cannot run with."""
    if prompts < 1 or repeats < 1:
        raise BenchError("--prompts and --repeats must be at least 1")
    if interleave < 0:
        raise BenchError(
            f"--interleave must be >= 0 (0 runs the methods one after another), got {interleave}"
        )
    if window < 1:
        raise BenchError(f"--window must be at least 1 token (e.g. 256), got {window}")


def check_random_weights(
    model: str | None, other_sources: bool, tree: str | None, accept_length: float | None
) -> dict[str, Any]:
    """A `--random-weights` request checked before any weights are built: `model` names the shape
    (no other source, `other_sources`), the tree is static and `accept_length` within what it can
    commit. Returns the preset's generation defaults (empty for a model directory)."""
    from tokenswift_trt.builder.presets import PRESETS

    if model is None or other_sources:
        raise BenchError(
            "--random-weights takes --model (a preset or model directory whose shape is timed) and no "
            "--model-dir, --engine, --heads or --prompt-file"
        )
    if tree in (None, "auto"):
        raise BenchError(
            "--random-weights needs a static --tree (e.g. 1,3,3,3): `auto` tunes on acceptance, which "
            "random weights do not have"
        )
    if accept_length is not None and not 1 <= accept_length < float("inf"):  # nan and inf too
        raise BenchError(f"--accept-length must be at least 1 (tokens per iteration), got {accept_length}")
    cap = trie_cap(tree)
    if accept_length is not None and accept_length > cap:
        raise BenchError(
            f"--accept-length {accept_length:g} is more than tree {tree} can commit in one iteration "
            f"(its depth + 1 = {cap}): give at most {cap}"
        )
    return dict(PRESETS[model].defaults) if model in PRESETS else {}


def random_weights_engine(
    model: str,
    dtype: str | None,
    device: str,
    kernels: dict[str, Any],
    prefix_lens: Sequence[int],
    prompts: int,
) -> tuple[Engine, list[int]]:
    """(an engine of `model`'s shape with random weights built on `device`, random prompt ids: enough
    for `prompts` windows of the longest prefix length)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError("--device cuda but no CUDA GPU is visible to PyTorch: use --device cpu")
    try:
        engine, _ = random_engine(
            model, getattr(torch, dtype) if dtype else None, device, kernels=KernelConfig().updated(kernels)
        )
    except RuntimeError as error:  # too little memory, CUDA errors
        raise BenchError(str(error)) from None
    count = max(prefix_lens) * (prompts + 1)  # prompt_windows spreads its windows over the ids
    ids = torch.randint(3, engine.config.vocab_size, (count,), generator=torch.Generator().manual_seed(0))
    return engine, ids.tolist()


@dataclass(frozen=True)
class BenchJob:
    """A bench run: what to run (`spec`), where its report goes and what the report records."""

    spec: BenchSpec
    out: Path = Path("runs/bench")
    command: str = "tokenswift-trt bench"
    source: str = ""  # the model's name in the report
    device: str = "cpu"
    # with random weights: the preset or directory whose shape is timed, and the tokens per iteration
    # the modeled speedup assumes (the rows gain measured times, the report a modeled long run)
    random_weights_model: str | None = None
    accept_length: float | None = None
    tp: int = 1  # tensor-parallel ranks the runs were split over


@dataclass
class BenchOutcome:
    rows: list[dict[str, Any]]
    columns: list[str]  # the columns worth printing, in order
    meta: dict[str, Any]  # as written into bench.json
    written: list[Path]
    long_run: dict[str, Any] | None = None  # random weights, two or more prompt lengths

    @property
    def tokens_equal_ar(self) -> bool:
        """Every TokenSwift run (adapted ones too) emitted AR's tokens."""
        return all(row["tokens_equal_ar"] and row.get("adapted_tokens_equal_ar", True) for row in self.rows)


def run_comparison(
    engine: Engine,
    text_ids: Sequence[int],
    spec: BenchSpec,
    progress: Callable[[str, int], Callable[[list[int]], None]],
) -> list[dict[str, Any]]:
    """The bench's rows on `engine`, prompts cut from `text_ids`: one per (prefix length, generation
    length). `progress(label, total)` returns the callback a run reports its new tokens to."""
    longest = max(spec.prefix_lens) + max(spec.gen_lens)
    limit = spec.config.max_length or engine.config.max_position_embeddings
    if longest > limit:
        raise BenchError(
            f"prefix {max(spec.prefix_lens)} + generation {max(spec.gen_lens)} exceeds the maximum "
            f"length {limit}"
        )
    return run_bench(engine, text_ids, spec, progress)


def write_comparison(engine: Engine, rows: list[dict[str, Any]], job: BenchJob) -> BenchOutcome:
    """The report of `run_comparison`'s rows under `job.out` (with random weights, the rows gain the
    measured times and the speedup they imply first)."""
    spec, config = job.spec, job.spec.config
    meta = {
        "command": job.command,
        "source": job.source,
        "tree": str(config.tree),
        "ngram_topk": config.ngram_topk,
        "draft_source": config.resolved_draft_source,
        "sampling": vars(config.sampling),
        "kv_budget": config.kv_budget,
        "adapt_drafts": config.adapts_drafts,  # the tokenswift runs' layers adapt (--adapt-drafts)
        "adaptation": asdict(config.adaptation),  # their settings, and the adapted runs' of a comparison
        "device": job.device,
        "dtype": str(engine.dtype),
        "interleave": spec.interleave,
        "window_tokens": spec.window_tokens,
        "kernels": engine.kernels.to_dict(),
        "tp": job.tp,
    }
    steps = engine.model
    if getattr(steps, "torch_model", None) is steps:  # a PyTorch engine: what its steps ran
        meta.update(
            attention=steps.attention_summary(),
            fused_elementwise=steps.fused_elementwise,
            batch_invariant=steps.batch_invariant,
        )
    long_run = None
    if job.random_weights_model is not None:
        accept_length = job.accept_length if job.accept_length is not None else trie_cap(config.tree)
        meta.update(model=job.random_weights_model, random_weights=True, accept_length=accept_length)
        for row in rows:
            row.update(measured_iteration_times(row, accept_length))
        long_run = modeled_long_run(rows, accept_length)
        if long_run is not None:  # e.g. --prefix-len 4096,32768,65536,98304: a ~100K-token generation
            meta["modeled_long_run"] = long_run
    written = write_results(rows, job.out, meta)
    columns = list(COLUMNS)
    if "auto_vs_default_tree" in rows[0]:
        columns.insert(5, "auto_vs_default_tree")
    if job.random_weights_model is not None:
        columns = list(RANDOM_WEIGHTS_COLUMNS)
    columns = [column for column in columns if column in rows[0]]
    return BenchOutcome(rows, columns, meta, written, long_run)
