"""`tokenswift-trt bench`: AR vs TokenSwift on the same engine, prompts and sampling settings.

One generation per method, prompt and repeat runs to the longest requested length; the figures
at shorter lengths are read at the moment each length is reached (what a separate run of that
length would measure, since decoding is deterministic up to there).

By default the methods take turns (`interleave` new tokens each, the order rotating every turn)
and each is timed on its own clock, the time spent in its own decoding steps: a machine whose
speed drifts by 20-30% over minutes (shared CPUs do) then slows every method alike, and the
ratios are side by side. `interleave = 0` runs the methods one after another instead.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tokenswift_trt.decode.autotune import Plan, describe_plans
from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.loop import DecodeSteps, decode_steps
from tokenswift_trt.decode.stats import WINDOW_TOKENS, Stats, Window
from tokenswift_trt.environment import machine_meta
from tokenswift_trt.model.engine import Engine

from .metrics import acceptance_rate, distinct_n, spread
from .report import write_csv

DEFAULT_TREE = "1,3,3,3"


@dataclass
class Snapshot:
    """Cumulative figures of one run when it reached a generation length."""

    new_tokens: int
    elapsed_s: float
    accepted: int
    drafted: int
    ngram_accepted: int
    iterations: int
    forwards: int
    prefill_s: float = 0.0  # of elapsed_s: the prompt's forwards and the first token's sample
    reached_by_depth: tuple[int, ...] = ()  # `Stats.reached_by_depth` / `accepted_by_depth` then
    accepted_by_depth: tuple[int, ...] = ()
    windows: tuple[Window, ...] = ()  # `Stats.windows` then
    window_ends_s: tuple[float, ...] = ()  # per window, the run's clock after its last iteration
    draft_updates: int = 0  # `Stats.draft_updates` then: the adapted layers' optimiser steps

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s

    @property
    def decode_ms_per_iteration(self) -> float:
        """Decoding time per iteration (AR: per step), the prompt's prefill left out."""
        return 1e3 * (self.elapsed_s - self.prefill_s) / max(1, self.iterations)

    def window_tokens_per_s(self) -> list[float]:
        """Tokens per second of each window's iterations on the run's clock (the prefill left out;
        0 for a window no iteration began in)."""
        rates, begin = [], self.prefill_s
        for window, end in zip(self.windows, self.window_ends_s):
            rates.append(window.tokens / (end - begin) if end > begin else 0.0)
            begin = end
        return rates

    @classmethod
    def of(cls, stats: Stats, elapsed_s: float, window_ends_s: Sequence[float] = ()) -> Snapshot:
        return cls(
            stats.new_tokens,
            elapsed_s,
            stats.accepted_tokens,
            stats.drafted_tokens,
            stats.ngram_accepted_tokens,
            stats.iterations,
            stats.forwards,
            stats.prefill_s,
            tuple(stats.reached_by_depth),
            tuple(stats.accepted_by_depth),
            tuple(window.copy() for window in stats.windows),
            tuple(window_ends_s),
            stats.draft_updates,
        )


@dataclass
class Run:
    tokens: list[int]
    snapshots: dict[int, Snapshot]  # gen_len -> snapshot
    plans: list[Plan] = field(default_factory=list)


def _record(
    snapshots: dict[int, Snapshot],
    targets: Sequence[int],
    stats: Stats,
    elapsed_s: float,
    window_ends: list[float],
) -> None:
    """After an iteration: note the clock as its window's end (in `window_ends`), then snapshot every
    target length (sorted) that `stats` has reached and none has recorded yet."""
    window_ends.extend([elapsed_s] * (len(stats.windows) - len(window_ends)))
    if window_ends:
        window_ends[-1] = elapsed_s
    while len(snapshots) < len(targets) and stats.new_tokens >= targets[len(snapshots)]:
        snapshots[targets[len(snapshots)]] = Snapshot.of(stats, elapsed_s, window_ends)


def take_turns(
    steps: dict[str, DecodeSteps], chunk: int, observe: Callable[[str, Stats, float], None] | None = None
) -> dict[str, tuple[list[int], Stats, float]]:
    """Run several generations (decode_steps) in turns of `chunk` new tokens each, the first of a
    turn rotating; returns per name (tokens, Stats, seconds on its own clock: the sum of its own
    steps). `observe(name, stats, clock)` sees every iteration."""
    names = list(steps)
    clocks = dict.fromkeys(names, 0.0)
    finished: dict[str, tuple[list[int], Stats]] = {}
    boundary, turn = chunk, 0
    while len(finished) < len(names):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            while name not in finished:
                start = time.perf_counter()
                try:
                    stats = next(steps[name])
                except StopIteration as done:
                    clocks[name] += time.perf_counter() - start
                    finished[name] = done.value
                    break
                clocks[name] += time.perf_counter() - start
                if observe:
                    observe(name, stats, clocks[name])
                if stats.new_tokens >= boundary:
                    break
        boundary, turn = boundary + chunk, turn + 1
    return {name: (*finished[name], clocks[name]) for name in names}


def run_interleaved(
    engine: Engine,
    prompt: Sequence[int],
    configs: dict[str, GenerationConfig],
    lengths: Sequence[int],
    chunk: int,
    on_tokens: Callable[[list[int]], None] | None = None,
    window_tokens: int = WINDOW_TOKENS,
) -> dict[str, Run]:
    """Every config decodes `prompt` to the longest of `lengths` (`take_turns`); each run's
    snapshots are read on its own clock."""
    targets = sorted(lengths)
    steps = {
        name: decode_steps(
            engine,
            prompt,
            replace(config, max_new_tokens=targets[-1], ignore_eos=True),
            on_tokens,
            window_tokens=window_tokens,
        )
        for name, config in configs.items()
    }
    snapshots: dict[str, dict[int, Snapshot]] = {name: {} for name in configs}
    window_ends: dict[str, list[float]] = {name: [] for name in configs}
    results = take_turns(
        steps,
        chunk,
        lambda name, stats, clock: _record(snapshots[name], targets, stats, clock, window_ends[name]),
    )
    return {name: Run(tokens, snapshots[name], stats.plans) for name, (tokens, stats, _) in results.items()}


@dataclass(frozen=True)
class BenchSpec:
    gen_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    prompts: int
    repeats: int
    config: GenerationConfig  # sampling, tree, k, budget, seed of the TokenSwift runs
    interleave: int = 256  # new tokens per method per turn; 0 = the methods one after another
    extras: bool = True  # also the penalty-off run (Distinct-n) and the paper's tree (auto vs paper)
    window_tokens: int = WINDOW_TOKENS  # output positions per window of the figures by position
    # TokenSwift with the engine's draft layers ("tokenswift") and with layers adapted online ("adapted")
    compare_adaptation: bool = False


def prompt_windows(text_ids: Sequence[int], prefix_len: int, count: int) -> list[list[int]]:
    """`count` prompts of `prefix_len` tokens at evenly spaced offsets of a tokenised text."""
    span = len(text_ids) - prefix_len
    if span < 0:
        raise ValueError(f"the prompt text has {len(text_ids)} tokens, fewer than --prefix-len {prefix_len}")
    step = span // max(1, count)
    return [list(text_ids[i * step : i * step + prefix_len]) for i in range(count)]


def run_order(names: list[str], repeat: int) -> list[str]:
    """Variants in the order one repeat runs them: AR and TokenSwift swap places every other repeat,
    so that the machine's drift during a run does not favour whichever goes first."""
    if repeat % 2 == 1:
        names = names[:]
        names[0], names[1] = names[1], names[0]
    return names


def run_bench(
    engine: Engine,
    text_ids: Sequence[int],
    spec: BenchSpec,
    progress: Callable[[str, int], Callable[[list[int]], None]],
) -> list[dict]:
    """Rows of figures, one per (prefix length, generation length)."""
    rows = []
    base = spec.config
    no_penalty = replace(base, sampling=replace(base.sampling, penalty=1.0))
    variants = {"ar": replace(base, method="ar"), "tokenswift": base}
    if spec.compare_adaptation:
        variants["tokenswift"] = replace(base, adapt_drafts=False)
        variants["adapted"] = replace(base, adapt_drafts=True)
    if spec.extras:
        variants["no_penalty"] = no_penalty
    if (
        spec.extras and base.tree.auto
    ):  # against the paper's static configuration: tree 1,3,3,3 drafted on the partial cache
        variants["default_tree"] = replace(base, tree=DEFAULT_TREE, draft_source="partial")
    for prefix_len in spec.prefix_lens:
        prompts = prompt_windows(text_ids, prefix_len, spec.prompts)
        runs: dict[str, list[Run]] = {name: [] for name in variants}
        for repeat in range(spec.repeats):
            for index, prompt in enumerate(prompts):
                seed = (base.seed or 0) + repeat
                configs = {
                    name: replace(variants[name], seed=seed) for name in run_order(list(variants), repeat)
                }
                where = f"prefix {prefix_len} prompt {index + 1}/{len(prompts)} run {repeat + 1}"
                if spec.interleave > 0:
                    label = f"{where}: {', '.join(configs)} by turns"
                    try:
                        results = run_interleaved(
                            engine,
                            prompt,
                            configs,
                            spec.gen_lens,
                            spec.interleave,
                            progress(label, max(spec.gen_lens) * len(configs)),
                            spec.window_tokens,
                        )
                    except GenerationError as error:
                        if not str(error).startswith("not enough memory"):
                            raise
                        raise GenerationError(
                            f"{error}; taking turns, the bench holds {len(configs)} generations' "
                            "caches at once: --interleave 0 runs them one at a time"
                        ) from None
                else:  # one after another: each config alone, in one turn
                    longest = max(spec.gen_lens)
                    results = {
                        name: run_interleaved(
                            engine,
                            prompt,
                            {name: config},
                            spec.gen_lens,
                            longest,
                            progress(f"{where}: {name}", longest),
                            spec.window_tokens,
                        )[name]
                        for name, config in configs.items()
                    }
                for name, run in results.items():
                    runs[name].append(run)
        for gen_len in sorted(spec.gen_lens):
            rows.append(_row(prefix_len, gen_len, runs))
    return rows


def alpha_by_depth(snapshots: Sequence[Snapshot]) -> list[float]:
    """α at each draft depth over several runs: accepted / reached, summed depth by depth."""
    depth = max((len(s.reached_by_depth) for s in snapshots), default=0)
    reached, accepted = [0] * depth, [0] * depth
    for snapshot in snapshots:
        for d, (r, a) in enumerate(zip(snapshot.reached_by_depth, snapshot.accepted_by_depth)):
            reached[d], accepted[d] = reached[d] + r, accepted[d] + a
    return [a / r if r else 0.0 for a, r in zip(accepted, reached)]


def merged_windows(snapshots: Sequence[Snapshot]) -> list[Window]:
    """The windows of several runs, their counts summed window by window."""
    merged: list[Window] = []
    for snapshot in snapshots:
        for index, window in enumerate(snapshot.windows):
            if len(merged) <= index:
                merged.append(Window(window.start, window.size))
            merged[index].add(window)
    return merged


def window_rows(swift: Sequence[Snapshot], ar: Sequence[Snapshot]) -> list[dict]:
    """TokenSwift's figures per window of output positions over the runs (`Window.figures`), with
    each method's tokens/s there (the median over the runs, each on its own clock)."""
    rows = []
    ar_rates = [snapshot.window_tokens_per_s() for snapshot in ar]
    swift_rates = [snapshot.window_tokens_per_s() for snapshot in swift]
    for index, window in enumerate(merged_windows(swift)):
        row = window.figures()
        for key in ("alpha", "beta", "tokens_per_iteration"):
            row[key] = round(row[key], 4)
        row["alpha_by_depth"] = [round(alpha, 4) for alpha in row["alpha_by_depth"]]
        for key, rates in (("ar_tokens_per_s", ar_rates), ("tokenswift_tokens_per_s", swift_rates)):
            values = [run[index] for run in rates if index < len(run)]
            row[key] = round(spread(values)[0], 2) if values else 0.0
        rows.append(row)
    return rows


def plans_before(plans: Sequence[Plan], gen_len: int) -> list[Plan]:
    """The `--tree auto` plans that started before token `gen_len`."""
    return [plan for plan in plans if plan.from_token < gen_len]


def _row(prefix_len: int, gen_len: int, runs: dict[str, list[Run]]) -> dict:
    ar = [r.snapshots[gen_len] for r in runs["ar"]]
    swift = [r.snapshots[gen_len] for r in runs["tokenswift"]]
    speedups = [s.tokens_per_s / a.tokens_per_s for a, s in zip(ar, swift)]
    median, low, high = spread(speedups)
    figures = _variant_figures("tokenswift", gen_len, runs)
    row = {
        "prefix_len": prefix_len,
        "gen_len": gen_len,
        "runs": len(speedups),
        "ar_tokens_per_s": round(spread([a.tokens_per_s for a in ar])[0], 2),
        "tokenswift_tokens_per_s": figures.pop("tokens_per_s"),
        "speedup": round(median, 3),
        "speedup_min": round(low, 3),
        "speedup_max": round(high, 3),
        "beta": round(
            acceptance_rate(sum(s.ngram_accepted for s in swift), sum(s.drafted for s in swift)), 4
        ),
        "tokens_per_forward": round(
            sum(s.new_tokens - 1 for s in swift) / max(1, sum(s.forwards for s in swift)), 3
        ),
        # per decode iteration, the prefill left out (at a 100K prompt it is seconds of the total)
        "ar_decode_ms_per_iteration": round(spread([a.decode_ms_per_iteration for a in ar])[0], 3),
        "tokenswift_decode_ms_per_iteration": figures.pop("decode_ms_per_iteration"),
        "prefill_s": round(spread([a.prefill_s for a in ar + swift])[0], 3),
        **figures,
    }
    if "default_tree" in runs:
        default = [r.snapshots[gen_len] for r in runs["default_tree"]]
        row["default_tree_tokens_per_s"] = round(spread([d.tokens_per_s for d in default])[0], 2)
        row["auto_vs_default_tree"] = round(
            spread([s.tokens_per_s / d.tokens_per_s for s, d in zip(swift, default)])[0], 3
        )
    if runs["tokenswift"][0].plans:
        row["auto_plans"] = " | ".join(describe_plans(plans_before(runs["tokenswift"][0].plans, gen_len)))
    for name, key in (("tokenswift", "penalty"), ("no_penalty", "no_penalty")):
        if name not in runs:
            continue
        for n in range(1, 5):
            values = [distinct_n(r.tokens[:gen_len], n) for r in runs[name]]
            row[f"distinct{n}_{key}"] = round(sum(values) / len(values), 4)
    if "adapted" in runs:  # the adapted layers' run (`BenchSpec.compare_adaptation`) beside the static one
        adapted = [r.snapshots[gen_len] for r in runs["adapted"]]
        row["adapted_vs_static"] = round(
            spread([a.tokens_per_s / s.tokens_per_s for a, s in zip(adapted, swift)])[0], 3
        )
        figures = _variant_figures("adapted", gen_len, runs)
        row.update({f"adapted_{key}": value for key, value in figures.items()})
    return row


def _variant_figures(name: str, gen_len: int, runs: dict[str, list[Run]]) -> dict:
    """A TokenSwift variant's figures at `gen_len` over its runs (`runs[name]`), beside AR's."""
    own = [r.snapshots[gen_len] for r in runs[name]]
    ar = [r.snapshots[gen_len] for r in runs["ar"]]
    accepted, drafted = sum(s.accepted for s in own), sum(s.drafted for s in own)
    same = all(a.tokens[:gen_len] == s.tokens[:gen_len] for a, s in zip(runs["ar"], runs[name]))
    return {
        "tokens_per_s": round(spread([s.tokens_per_s for s in own])[0], 2),
        "decode_ms_per_iteration": round(spread([s.decode_ms_per_iteration for s in own])[0], 3),
        "alpha": round(acceptance_rate(accepted, drafted), 4),
        # α at each draft depth (accepted / reached, over the runs), "/"-separated
        "alpha_by_depth": "/".join(f"{alpha:.3f}" for alpha in alpha_by_depth(own)),
        # τ: tokens committed per decode iteration (accepted drafts + 1)
        "tokens_per_iteration": round(1 + accepted / max(1, sum(s.iterations for s in own)), 3),
        # the optimiser steps of the adapted layers (--adapt-drafts; 0 without it)
        "draft_updates": sum(s.draft_updates for s in own),
        "tokens_equal_ar": same,
        "windows": window_rows(own, ar),  # figures by output position (bench_windows.csv)
    }


def flat_window_rows(rows: Sequence[dict]) -> list[dict]:
    """One CSV row per (prefix length, generation length, variant, window): α by depth as alpha_d1,
    alpha_d2...; the variant is "tokenswift", or "adapted" for the adapted layers' windows."""
    keys = (("tokenswift", "windows"), ("adapted", "adapted_windows"))
    depth = max(
        (len(w["alpha_by_depth"]) for row in rows for _, key in keys for w in row.get(key, [])), default=0
    )
    flat = []
    for row, (variant, key) in itertools.product(rows, keys):
        for window in row.get(key, []):
            by_depth = window["alpha_by_depth"]
            flat.append(
                {
                    "prefix_len": row["prefix_len"],
                    "gen_len": row["gen_len"],
                    "variant": variant,
                    **{column: window[column] for column in WINDOW_COLUMNS},
                    **{f"alpha_d{d + 1}": by_depth[d] if d < len(by_depth) else "" for d in range(depth)},
                    "ar_tokens_per_s": window["ar_tokens_per_s"],
                    "tokenswift_tokens_per_s": window["tokenswift_tokens_per_s"],
                }
            )
    return flat


WINDOW_COLUMNS = (
    "start",
    "end",
    "iterations",
    "tokens",
    "tokens_per_iteration",
    "drafted_tokens",
    "accepted_tokens",
    "alpha",
    "beta",
)


def write_results(rows: list[dict], out_dir: Path, meta: dict) -> list[Path]:
    """bench.csv, bench.json and bench_windows.csv (figures per window of output positions). `python -m
    tools.plot_benchmarks --run DIR` draws speedup and α against generation length from them, `--windows
    DIR/bench.json` the figures by position."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "bench.csv", out_dir / "bench.json"]
    write_csv(written[0], [{key: value for key, value in row.items() if key != "windows"} for row in rows])
    meta = {**meta, **machine_meta()}
    written[1].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    flat = flat_window_rows(rows)
    if flat:
        written.append(write_csv(out_dir / "bench_windows.csv", flat))
    return written
