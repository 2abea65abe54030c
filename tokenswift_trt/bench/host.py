"""Host overhead of a TokenSwift iteration: wall time not spent inside model calls.

Model calls (forward, draft, logits, head logits) are timed by a transparent proxy around the
engine's model; with a GPU each call is bracketed by a device synchronisation so that queued
kernels are charged to the model, not to the host. What remains per iteration is the n-gram
lookup, trie build, sampling, acceptance and cache bookkeeping (issue goal: <= 1 ms).

A second, identical generation counts the tensor operations dispatched outside model calls
(views and other metadata-only operations excluded): on a GPU each is at least one kernel launch,
so the count says what the host costs there even when measured on a CPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import SamplingConfig

TIMED_CALLS = ("forward", "draft", "logits", "head_logits")
# operations that launch nothing: they wrap, detach or alias tensors
NO_KERNEL = frozenset({"lift_fresh", "detach", "detach_", "alias"})


class TimedModel:
    """Forwards every attribute to `model`; accumulates seconds spent in TIMED_CALLS.

    Fixed-shape steps (CUDA graphs) would run the torch model behind this proxy's back and charge
    every verify and draft forward to the host, so generation through it takes the eager path."""

    fixed_shape_steps = False

    def __init__(self, model: object, device: torch.device) -> None:
        self._model = model
        self._device = device
        self.seconds = 0.0
        self.calls = 0
        self.depth = 0  # > 0 while inside a model call

    def _timed(self, name: str):
        method = getattr(self._model, name)

        def call(*args, **kwargs):
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            start = time.perf_counter()
            self.depth += 1
            try:
                result = method(*args, **kwargs)
            finally:
                self.depth -= 1
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return result

        return call

    def __call__(self, *args, **kwargs):
        return self._timed("forward")(*args, **kwargs)

    def __getattr__(self, name: str):
        if name in TIMED_CALLS:
            return self._timed(name)
        return getattr(self._model, name)


class HostOpCounter(TorchDispatchMode):
    """Counts tensor operations dispatched while `model` is not inside a model call and `counting`
    is set; views and the NO_KERNEL operations are not counted."""

    def __init__(self, model: TimedModel) -> None:
        super().__init__()
        self.model = model
        self.counting = False
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            self.counting
            and self.model.depth == 0
            and not func.is_view
            and func.overloadpacket.__name__ not in NO_KERNEL
        ):
            self.ops += 1
        return func(*args, **(kwargs or {}))


@dataclass
class HostOverhead:
    iterations: int
    new_tokens: int
    decode_s: float  # generation time after prefill
    model_s: float  # inside model calls during decoding
    phase_s: dict[str, float]
    host_ops: int | None = None  # tensor operations outside model calls over the same iterations

    @property
    def host_ops_per_iteration(self) -> float | None:
        return self.host_ops / self.iterations if self.host_ops is not None and self.iterations else None

    @property
    def host_ms_per_iteration(self) -> float:
        return (self.decode_s - self.model_s) / self.iterations * 1e3 if self.iterations else 0.0

    @property
    def model_ms_per_iteration(self) -> float:
        return self.model_s / self.iterations * 1e3 if self.iterations else 0.0

    @property
    def phase_ms_per_iteration(self) -> dict[str, float]:
        """The generation's phases (model calls included), ms per measured iteration."""
        return {name: seconds / self.iterations * 1e3 for name, seconds in self.phase_s.items()}


@dataclass
class DeviceLoopHostTime:
    """The device loop's host side: its own time per iteration (queue the captured graph and the
    report's copy) and its wait for the report of the iteration before."""

    tree: str
    ngram_topk: int
    iterations: int
    tokens: int
    mean_accept_length: float
    graph_replays: int
    host_ms_per_iteration: float
    wait_ms_per_iteration: float
    tokens_per_s: float


def device_loop_host_time(
    engine: Engine, prompt: Sequence[int], config: GenerationConfig
) -> DeviceLoopHostTime:
    """Generate with `config` (its `device_loop` on) and read the host's and the wait's time per
    iteration from the generation's phases."""
    tokens, stats = generate(engine, prompt, config)
    per_iteration = {name: seconds / stats.iterations * 1e3 for name, seconds in stats.phase_s.items()}
    return DeviceLoopHostTime(
        str(config.tree),
        config.ngram_topk,
        stats.iterations,
        len(tokens),
        stats.mean_accept_length,
        stats.graph_replays,
        per_iteration.get("host", 0.0),
        per_iteration.get("wait", 0.0),
        stats.tokens_per_s,
    )


def measure_host_overhead(
    engine: Engine, prompt: Sequence[int], config: GenerationConfig, count_ops: bool = True
) -> HostOverhead:
    """Generate with `config` (TokenSwift) and split decode time into model and host; with
    `count_ops`, generate again and count the host's tensor operations (HostOpCounter).

    Both are counted from the end of the first iteration to the end of the last, so prefill and
    the first iteration's warm-up are excluded exactly.
    """
    if config.compile_steps:
        raise ValueError(
            "bench-host times the host loop's model calls eagerly: use --compile-steps with --device-loop"
        )
    config = replace(config, method="tokenswift")
    timed = TimedModel(engine.model, engine.device)
    timed_engine = replace(engine, model=timed)  # same weights and caches; only timing added
    marks: list[tuple[int, float, float]] = []  # (iteration, elapsed_s, model_s) after each iteration

    def observe(stats) -> None:
        marks.append((stats.iterations, stats.elapsed_s, timed.seconds))

    tokens, stats = generate(timed_engine, prompt, config, observer=observe)
    if len(marks) < 2:
        raise ValueError("host overhead needs at least two decoding iterations: raise max_new_tokens")
    (first_iteration, first_elapsed, first_model), (last_iteration, last_elapsed, last_model) = (
        marks[0],
        marks[-1],
    )
    result = HostOverhead(
        last_iteration - first_iteration,
        stats.new_tokens,
        last_elapsed - first_elapsed,
        last_model - first_model,
        dict(stats.phase_s),
    )
    if count_ops:
        counter = HostOpCounter(timed)

        def start_counting(stats) -> None:
            counter.counting = True  # after the first iteration, as for the times

        with counter:
            again, _ = generate(
                timed_engine, prompt, replace(config, seed=stats.seed), observer=start_counting
            )
        assert again == tokens, "same seed, same tokens: the count covers the same work"
        result.host_ops = counter.ops
    return result


def reference_host_ms(engine: Engine, kv_budget: int) -> float:
    """Host ms per iteration of a reference run on this engine (what `bench-steps` models with when
    not given one): 256 tokens after a random 512-token prompt, tree 1,3,3,3, k = 20, min-p 0.1, θ 1.2."""
    prompt = torch.randint(
        3, engine.config.vocab_size, (512,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    config = GenerationConfig(
        max_new_tokens=256,
        tree="1,3,3,3",
        ngram_topk=20,
        kv_budget=min(kv_budget, 512),
        sampling=SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=1024),
        seed=0,
        ignore_eos=True,
    )
    return measure_host_overhead(engine, prompt, config).host_ms_per_iteration
