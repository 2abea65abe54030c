"""`tokenswift-trt bench-steps`: what one decoding step costs, and the speedup it implies.

Steps, each timed on caches that hold `context` random positions:
- ar: 1 token on the full cache + its logits (one autoregressive step),
- draft: 1 token on the partial cache (budget B) + logits of the base head and every draft layer
  (the paper's separate draft pass),
- heads: the draft layers + LM head on one hidden row (drafting from the verify pass: no forward),
- verify_T{T}: T tokens with a tree (causal) mask on the full cache + logits of all T rows.

A step's bandwidth time is the bytes it must read at least once ÷ the measured copy bandwidth:
the weights it uses (decoder layers, final norm, LM head, the T embedding rows it looks up; the
draft layers for draft/heads) plus the K/V it attends to (2·layers·kv_heads·head_dim·element
bytes per cached position: `context` for ar/verify, min(B, context) for draft). It is the floor a
memory-bound step cannot beat; logits and activations (< 1% for an 8B model) are not counted.

`modeled_speedup` turns step costs into end-to-end figures. With τ the mean tokens committed per
iteration (accept length), a generated token at context c costs
    AR:         ar(c)
    TokenSwift: (draft(c) + verify_T(c) + host) / τ      drafting mode "partial" (the paper)
                (heads(c) + verify_T(c) + host) / τ      drafting mode "verify" (beyond the paper)
and the times for N tokens after a prompt of P are the sums over c = P .. P + N - 1, with step costs
interpolated linearly between measured contexts (the end segments extended beyond them, never
downwards).
"""

from __future__ import annotations

import functools
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from tokenswift_trt.builder.build import BuildRequest, resolve
from tokenswift_trt.decode.admission import GIB, available_bytes, plan_memory
from tokenswift_trt.decode.static_step import StaticForward, bucket_for
from tokenswift_trt.environment import machine_meta
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.config import config_from_dict, load_config
from tokenswift_trt.model.decoder import LlamaModel
from tokenswift_trt.model.draft_layers import DraftLayers
from tokenswift_trt.model.engine import Engine, choose_kernels
from tokenswift_trt.model.kv_cache import KVCache, PartialKVCache
from tokenswift_trt.model.linear import pack_linears

from .report import write_csv

# The paper's speedups for LLaMA3.1-8B on an A100 80G (prefix 4096, α 0.84; Table 1 of arXiv
# 2502.18890), keyed by generated tokens: "100K" is the research code's --gen_len 102400.
PAPER_A100_LLAMA31_8B: dict[int, float] = {20480: 1.93, 40960: 2.47, 61440: 2.88, 81920: 3.13, 102400: 3.27}
DEFAULT_GEN_LENGTHS = tuple(PAPER_A100_LLAMA31_8B)
DEFAULT_PROMPT_LENGTH = 4096
DRAFT_MODES = ("partial", "verify")
FILL_CHUNK = 4096  # random positions written into a cache per attend_kv call


class StepBenchError(ValueError):
    """The step benchmark cannot run as asked (the message names the figure to change)."""


@dataclass
class StepCost:
    context: int  # cached positions the step attends to (full cache)
    step: str  # "ar", "draft", "heads" or "verify_T{T}"
    tokens: int  # tokens in the forward (1, or T for verify)
    seconds: float  # median wall time of one step
    bytes_read: int  # weights used + K/V attended, each read once
    bandwidth_seconds: float  # bytes_read ÷ measured copy bandwidth: the memory-bound floor


@dataclass
class ModeledSpeedup:
    gen_length: int  # N tokens generated after the prompt
    mode: str  # "partial" (separate draft pass) or "verify" (draft from the verify pass)
    accept_length: float  # τ: mean tokens committed per iteration
    tree_size: int  # T tokens per verify pass
    ar_seconds: float
    tokenswift_seconds: float

    @property
    def speedup(self) -> float:
        return self.ar_seconds / self.tokenswift_seconds


def verify_step(tree_size: int) -> str:
    return f"verify_T{tree_size}"


# ---------------------------------------------------------------- engine


def random_engine(
    model: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    kernels: KernelConfig = KernelConfig(),
) -> tuple[Engine, str]:
    """(engine, dtype name) for a preset's shape, or a model directory's config.json, with random weights.

    Built in memory: meta-initialised, allocated on `device` in `dtype` (default: the preset's,
    else float32) and filled there (norms 1, other weights N(0, 0.02)); no checkpoint is read.
    `kernels` chooses its kernels and fusions as `load_engine` does.
    """
    preset, directory = resolve(BuildRequest(model=model, out=Path("."), random_weights=True))
    config = config_from_dict(preset.config) if preset is not None else load_config(directory)
    if dtype is None:
        dtype = getattr(torch, preset.dtype) if preset is not None else torch.float32
    device = torch.device(device)
    with torch.device("meta"):
        base = LlamaModel(config, device="meta").to(dtype)
        draft_layers = DraftLayers(config, config.num_draft_layers).to(dtype)
    element = torch.tensor([], dtype=dtype).element_size()
    needed = sum(p.numel() for p in list(base.parameters()) + list(draft_layers.parameters())) * element
    free = available_bytes(device)
    if needed > free:
        raise StepBenchError(
            f"{model} in {dtype} needs {needed / GIB:.2f} GiB of weights but {free / GIB:.2f} GiB "
            f"is free on {device}"
        )
    base.to_empty(device=device)
    draft_layers.to_empty(device=device)
    base.tie_weights()
    base.rotary.to(device)
    fill_random([*base.named_parameters(), *draft_layers.named_parameters()], device, seed)
    base.eval()
    draft_layers.eval()
    choose_kernels(base, config, dtype, device, kernels)
    base.pack(kernels)  # CPU only, as load_engine does
    pack_linears(draft_layers, half=True, kernels=kernels)
    engine = Engine(config, base, draft_layers, False, dtype, device, kernels=kernels)
    return engine, str(dtype).removeprefix("torch.")


def fill_random(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], device: torch.device, seed: int
) -> None:
    """Random weights in place: norms 1, every other parameter N(0, 0.02), from one seeded generator."""
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in named_parameters:
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)


# ---------------------------------------------------------------- measurement


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(call: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median seconds of `call` over `repeats` runs.

    On CUDA each run is timed with device events around 5 back-to-back calls (so launch gaps of
    one short call do not count); elsewhere with the host clock between synchronisations.
    """
    for _ in range(warmup):
        call()
    samples = []
    if device.type == "cuda":
        per_sample = 5
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_sample):
                call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / per_sample)
        return statistics.median(samples)
    for _ in range(repeats):
        synchronize(device)
        start_s = time.perf_counter()
        call()
        synchronize(device)
        samples.append(time.perf_counter() - start_s)
    return statistics.median(samples)


def measure_copy_bandwidth(device: torch.device, megabytes: int | None = None, repeats: int = 10) -> float:
    """Bytes/s of dst.copy_(src), read + write counted; `megabytes` None: 1 GiB on CUDA, 256 MiB on
    a CPU."""
    megabytes = megabytes or (1024 if device.type == "cuda" else 256)
    elements = megabytes * (1 << 20) // 4
    source = torch.empty(elements, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    seconds = time_call(lambda: target.copy_(source), device, repeats)
    return 2 * source.numel() * 4 / seconds


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{properties.name} ({properties.multi_processor_count} SMs), CUDA {torch.version.cuda}"
    return f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"


@dataclass(frozen=True)
class StepBytes:
    """Bytes one step reads, by part (see the module docstring)."""

    decoder: int  # decoder layers + final norm + LM head (the embedding table counts when tied to the head)
    embedding_row: int  # one looked-up embedding row (0 when tied: the head already counts the table)
    draft_layers: int
    head: int  # final norm + LM head
    kv_per_position: int  # K and V, all layers

    @classmethod
    def of(cls, engine: Engine) -> StepBytes:
        model = engine.model.torch_model
        config = engine.config
        element = torch.tensor([], dtype=engine.dtype).element_size()
        tied = config.tie_word_embeddings
        embedding = model.model.embed_tokens.weight
        decoder = _bytes(model.parameters()) - (0 if tied else embedding.numel() * embedding.element_size())
        return cls(
            decoder=decoder,
            embedding_row=0 if tied else config.hidden_size * embedding.element_size(),
            draft_layers=_bytes(engine.draft_layers.parameters()),
            head=_bytes(model.lm_head.parameters()) + _bytes(model.model.norm.parameters()),
            kv_per_position=2 * config.num_layers * config.num_kv_heads * config.head_dim * element,
        )


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def filled_caches(engine: Engine, context: int, capacity: int, budget: int) -> tuple[KVCache, PartialKVCache]:
    """A full cache of `capacity` slots holding `context` random positions, and a partial cache of `budget`
    filled from it."""
    config, device, dtype = engine.config, engine.device, engine.dtype
    full = KVCache(
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        capacity,
        dtype=dtype,
        device=device,
        settings=engine.kernels,
    )
    for start in range(0, context, FILL_CHUNK):
        count = min(FILL_CHUNK, context - start)
        keys = torch.randn(config.num_kv_heads, count, config.head_dim, dtype=dtype, device=device)
        values = torch.randn_like(keys)
        for layer in range(config.num_layers):
            full.attend_kv(layer, keys, values)
        full.commit()
    partial = PartialKVCache(
        config.num_layers, config.num_kv_heads, config.head_dim, budget, dtype=dtype, device=device
    )
    queries = [
        torch.randn(config.num_heads, config.head_dim, dtype=dtype, device=device)
        for _ in range(config.num_layers)
    ]
    partial.select(full, queries)  # min(budget, context) - recent slots once the context exceeds the budget
    if context > budget:  # the recent region, so that the draft attends to exactly `budget` positions
        partial.append_from(full, context - partial.recent, partial.recent, queries)
    return full, partial


def check_step_request(
    engine: Engine, contexts: Sequence[int], tree_sizes: Sequence[int], kv_budget: int, repeats: int
) -> None:
    """Raise `StepBenchError` for arguments `measure_step_costs` cannot run (memory is checked per context
    there)."""
    if not contexts or min(contexts) < 2:
        raise StepBenchError(f"contexts must be at least 2 positions, got {list(contexts)}")
    if not tree_sizes or min(tree_sizes) < 1:
        raise StepBenchError(f"tree sizes must be at least 1 token, got {list(tree_sizes)}")
    if kv_budget < 2 or repeats < 1:
        raise StepBenchError(
            f"the partial KV budget must be >= 2 and repeats >= 1, got {kv_budget} and {repeats}"
        )
    limit = engine.config.max_position_embeddings
    if max(contexts) + max(tree_sizes) > limit:
        raise StepBenchError(
            f"context {max(contexts)} + tree {max(tree_sizes)} exceeds the model's maximum length {limit}"
        )


Record = Callable[[str, int, Callable[[], object], int], None]  # (step, tokens, call, bytes read)


def _measure_context(
    engine: Engine,
    context: int,
    capacity: int,
    budget: int,
    tree_sizes: Sequence[int],
    sizes: StepBytes,
    record: Record,
    static: bool,
    compiled: bool = False,
) -> None:
    """Fill the caches for one context and time every step on them; they are freed on return.

    static: run the forwards as generate() does with static_steps (fixed shapes; CUDA graphs on a GPU);
    compiled: those forwards through torch.compile (generate's compile_steps).
    """
    config, device, model, draft_layers = engine.config, engine.device, engine.model, engine.draft_layers
    full, partial = filled_caches(engine, context, capacity, budget)
    token = torch.randint(config.vocab_size, (1,), device=device)
    position = torch.tensor([context], device=device)
    hidden_row = torch.randn(1, config.hidden_size, dtype=engine.dtype, device=device)
    capture = device.type == "cuda"
    full_runner = StaticForward(model, full, capture, compiled) if static else None
    partial_runner = StaticForward(model, partial, capture, compiled) if static else None

    def forward_full(
        tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if full_runner is not None:
            return full_runner.run(tokens, positions, mask).hidden
        return model(tokens, positions, full, tree_mask=None if mask is None else mask.to(device)).hidden

    def ar() -> None:
        model.logits(forward_full(token, position, None)[-1:])
        full.rollback(0)  # drops the pending slot

    def draft() -> None:
        if partial_runner is not None:
            model.head_logits(partial_runner.run(token, position).hidden, draft_layers)
        else:
            model.draft(token, position, partial, draft_layers)

    record("ar", 1, ar, sizes.decoder + sizes.embedding_row + sizes.kv_per_position * context)
    record(
        "draft",
        1,
        draft,
        sizes.decoder + sizes.embedding_row + sizes.draft_layers + sizes.kv_per_position * budget,
    )
    record("heads", 1, lambda: model.head_logits(hidden_row, draft_layers), sizes.draft_layers + sizes.head)
    for size in tree_sizes:
        tokens = torch.randint(config.vocab_size, (size,), device=device)
        positions = torch.arange(context, context + size, device=device)
        mask = torch.ones(size, size, dtype=torch.bool).tril()  # a chain is a valid tree (host, as tries are)

        def verify(tokens=tokens, positions=positions, mask=mask) -> None:
            model.logits(forward_full(tokens, positions, mask))
            full.rollback(0)

        record(
            verify_step(size),
            size,
            verify,
            sizes.decoder + size * sizes.embedding_row + sizes.kv_per_position * context,
        )


def measure_step_costs(
    engine: Engine,
    contexts: Sequence[int],
    tree_sizes: Sequence[int],
    kv_budget: int,
    repeats: int,
    bandwidth: float | None = None,  # bytes/s; measured with `measure_copy_bandwidth` when None
    on_step: Callable[[StepCost], None] | None = None,
    static_steps: bool | None = None,  # fixed-shape / CUDA-graph steps; None = on for CUDA
    compile_steps: bool = False,  # those steps through torch.compile (implies static steps)
) -> list[StepCost]:
    """Median seconds (after 2 warm-ups) of the ar, draft, heads and verify_T steps at each context."""
    check_step_request(engine, contexts, tree_sizes, kv_budget, repeats)
    device = engine.device
    static = (device.type == "cuda" if static_steps is None else static_steps) or compile_steps
    longest_tree = bucket_for(max(tree_sizes)) if static else max(tree_sizes)
    bandwidth = bandwidth or measure_copy_bandwidth(device)
    sizes = StepBytes.of(engine)
    costs: list[StepCost] = []

    def record(context: int, step: str, tokens: int, call: Callable[[], object], bytes_read: int) -> None:
        seconds = time_call(call, device, repeats, warmup=2)
        cost = StepCost(context, step, tokens, seconds, bytes_read, bytes_read / bandwidth)
        costs.append(cost)
        if on_step:
            on_step(cost)

    for context in sorted(contexts):
        budget = min(kv_budget, context)
        capacity = context + longest_tree + 1
        plan = plan_memory(engine, capacity, budget, longest_tree)
        free = available_bytes(device)
        if plan.needed_bytes > free:
            raise StepBenchError(
                f"context {context}: its caches need {plan.needed_bytes / GIB:.2f} GiB but "
                f"{free / GIB:.2f} GiB is free on {device}: measure smaller contexts"
            )
        try:
            with torch.inference_mode():
                _measure_context(
                    engine,
                    context,
                    capacity,
                    budget,
                    tree_sizes,
                    sizes,
                    functools.partial(record, context),
                    static,
                    compile_steps,
                )
        except torch.OutOfMemoryError:
            raise StepBenchError(
                f"context {context}: out of memory on {device} (caches of "
                f"{plan.needed_bytes / GIB:.2f} GiB): measure smaller contexts"
            ) from None
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return costs


def measure_accept_lengths(
    model_dir: str | Path, gen_tokens: int = 2048, seed: int = 1
) -> tuple[float, float]:
    """τ (tokens per iteration) of a trained model, drafting from the partial cache (tree 1,3,3,3)
    and from the verify pass (tree 3,3,3), k = 20, min-p 0.1, θ 1.2 (W 256 for small models, the
    paper's B 4096): an acceptance profile measured by generation instead of assumed."""
    import warnings

    from tokenswift_trt.decode.config import GenerationConfig
    from tokenswift_trt.decode.loop import generate
    from tokenswift_trt.decode.text import TextCodec
    from tokenswift_trt.model.engine import UntrainedDraftLayersWarning, load_engine
    from tokenswift_trt.model.sampling import SamplingConfig

    directory = Path(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntrainedDraftLayersWarning)
        engine = load_engine(directory)
    prompt_file = directory / "prompt.txt"
    if prompt_file.is_file():
        prompt = TextCodec.from_dir(directory).encode(prompt_file.read_text(encoding="utf-8"))[:512]
    else:
        prompt = torch.randint(
            3, engine.config.vocab_size, (512,), generator=torch.Generator().manual_seed(seed)
        ).tolist()
    sampling = SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=256)
    lengths = []
    for tree, source in (("1,3,3,3", "partial"), ("3,3,3", "verify")):
        config = GenerationConfig(
            max_new_tokens=gen_tokens,
            sampling=sampling,
            tree=tree,
            ngram_topk=20,
            kv_budget=4096,
            draft_source=source,
            seed=seed,
            ignore_eos=True,
        )
        lengths.append(generate(engine, prompt, config)[1].mean_accept_length)
    return lengths[0], lengths[1]


# ---------------------------------------------------------------- model


def interpolate(points: Sequence[tuple[int, float]], at: np.ndarray) -> np.ndarray:
    """Piecewise linear through (context, seconds) points, evaluated at contexts `at`.

    Beyond the measured range the end segment is extended, its slope floored at 0 (a step never
    gets cheaper with more context: a falling end segment is timing noise); one point: constant.
    """
    xs = np.array([p[0] for p in sorted(points)], dtype=np.float64)
    ys = np.array([p[1] for p in sorted(points)], dtype=np.float64)
    at = np.asarray(at, dtype=np.float64)
    if len(xs) == 1:
        return np.full_like(at, ys[0])
    inside = np.interp(at, xs, ys)
    first_slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
    last_slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    below = ys[0] + first_slope * (at - xs[0])
    above = ys[-1] + last_slope * (at - xs[-1])
    return np.maximum(np.where(at < xs[0], below, np.where(at > xs[-1], above, inside)), 0.0)


def _curve(costs: Sequence[StepCost], step: str, contexts: np.ndarray) -> np.ndarray:
    points = [(c.context, c.seconds) for c in costs if c.step == step]
    if not points:
        raise StepBenchError(f"no measured {step!r} step: measured {sorted({c.step for c in costs})}")
    return interpolate(points, contexts)


# Most tokens one iteration commits (every level accepted, plus the bonus token) with the trees the model
# assumes: partial-cache drafting runs tree 1,3,3,3, verify-pass drafting tree 3,3,3.
PARTIAL_TREE_CAP = 5
VERIFY_TREE_CAP = 4


def modeled_speedup(
    costs: Sequence[StepCost],
    prompt_length: int,
    gen_lengths: Sequence[int],
    accept_length_partial: float,
    accept_length_verify: float,
    verify_tree_size: int,
    host_overhead_s: float = 0.0,
) -> list[ModeledSpeedup]:
    """One row per (generation length, drafting mode); see the module docstring for the model."""
    if min(accept_length_partial, accept_length_verify) < 1:
        raise StepBenchError("accept lengths must be >= 1 (every iteration commits at least one token)")
    for mode, tau, cap in (
        ("partial-cache", accept_length_partial, PARTIAL_TREE_CAP),
        ("verify-pass", accept_length_verify, VERIFY_TREE_CAP),
    ):
        if tau > cap:
            raise StepBenchError(
                f"τ {tau:g} for {mode} drafting is more than its tree commits in one iteration ({cap}: "
                "its depth + 1): give at most that"
            )
    if not gen_lengths or min(gen_lengths) < 1:
        raise StepBenchError(f"generation lengths must be positive, got {list(gen_lengths)}")
    contexts = prompt_length + np.arange(
        max(gen_lengths), dtype=np.float64
    )  # context of each generated token
    verify = _curve(costs, verify_step(verify_tree_size), contexts)
    ar = np.cumsum(_curve(costs, "ar", contexts))
    per_mode = {
        "partial": (
            accept_length_partial,
            np.cumsum((_curve(costs, "draft", contexts) + verify + host_overhead_s) / accept_length_partial),
        ),
        "verify": (
            accept_length_verify,
            np.cumsum((_curve(costs, "heads", contexts) + verify + host_overhead_s) / accept_length_verify),
        ),
    }
    rows = []
    for gen_length in gen_lengths:
        for mode in DRAFT_MODES:
            tau, swift = per_mode[mode]
            rows.append(
                ModeledSpeedup(
                    gen_length,
                    mode,
                    tau,
                    verify_tree_size,
                    float(ar[gen_length - 1]),
                    float(swift[gen_length - 1]),
                )
            )
    return rows


# ---------------------------------------------------------------- report


def write_step_report(
    costs: Sequence[StepCost], speedups: Sequence[ModeledSpeedup], out_dir: Path, meta: dict
) -> list[Path]:
    """steps.csv, speedup.csv and steps.json (`python -m tools.plot_benchmarks --run DIR` draws
    steps.png from them: step ms by context, modeled speedup by generated length)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps_csv, speedup_csv, json_path = (out_dir / n for n in ("steps.csv", "speedup.csv", "steps.json"))
    step_rows = [
        {
            "context": c.context,
            "step": c.step,
            "tokens": c.tokens,
            "ms": round(c.seconds * 1e3, 4),
            "bandwidth_ms": round(c.bandwidth_seconds * 1e3, 4),
            "bandwidth_fraction": round(c.bandwidth_seconds / c.seconds, 4),
            "bytes_read": c.bytes_read,
        }
        for c in costs
    ]
    speedup_rows = [
        {
            "gen_length": s.gen_length,
            "mode": s.mode,
            "accept_length": s.accept_length,
            "tree_size": s.tree_size,
            "ar_s": round(s.ar_seconds, 3),
            "tokenswift_s": round(s.tokenswift_seconds, 3),
            "speedup": round(s.speedup, 3),
            "paper_a100_llama3.1_8b": PAPER_A100_LLAMA31_8B.get(s.gen_length, ""),
        }
        for s in speedups
    ]
    write_csv(steps_csv, step_rows)
    write_csv(speedup_csv, speedup_rows)
    meta = {**meta, **machine_meta(), "torch": torch.__version__}
    payload = {
        "meta": meta,
        "steps": [asdict(c) for c in costs],
        "speedup": [asdict(s) | {"speedup": s.speedup} for s in speedups],
        "paper_a100_llama3.1_8b": PAPER_A100_LLAMA31_8B,
    }
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    return [steps_csv, speedup_csv, json_path]
