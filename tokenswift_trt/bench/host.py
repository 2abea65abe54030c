"""Host time of a TokenSwift iteration: wall time not spent inside model calls (what `bench-steps`
models an iteration's host work with).

Model calls (forward, draft, logits, head logits) are timed by a transparent proxy around the
engine's model; with a GPU each call is bracketed by a device synchronisation so that queued
kernels are charged to the model, not to the host. What remains per iteration is the n-gram
lookup, trie build, sampling, acceptance and cache bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import SamplingConfig

TIMED_CALLS = ("forward", "draft", "logits", "head_logits")


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


@dataclass
class HostOverhead:
    iterations: int
    new_tokens: int
    decode_s: float  # generation time after prefill
    model_s: float  # inside model calls during decoding
    phase_s: dict[str, float]  # the generation's phases (model calls included), whole run
    seed: int  # the generation's seed (a second run with it commits the same tokens)

    @property
    def host_ms_per_iteration(self) -> float:
        return (self.decode_s - self.model_s) / self.iterations * 1e3 if self.iterations else 0.0

    @property
    def model_ms_per_iteration(self) -> float:
        return self.model_s / self.iterations * 1e3 if self.iterations else 0.0


def measure_host_overhead(engine: Engine, prompt: Sequence[int], config: GenerationConfig) -> HostOverhead:
    """Generate with `config` (TokenSwift) and split decode time into model and host, counted from the
    end of the first iteration to the end of the last (prefill and the first iteration's warm-up
    excluded exactly)."""
    if config.compile_steps:
        raise ValueError(
            "host time is measured with the host loop's model calls eager: use --compile-steps with "
            "--device-loop"
        )
    config = replace(config, method="tokenswift")
    timed = TimedModel(engine.model, engine.device)
    marks: list[tuple[int, float, float]] = []  # (iteration, elapsed_s, model_s) after each iteration

    def observe(stats) -> None:
        marks.append((stats.iterations, stats.elapsed_s, timed.seconds))

    _, stats = generate(replace(engine, model=timed), prompt, config, observer=observe)
    if len(marks) < 2:
        raise ValueError("host overhead needs at least two decoding iterations: raise max_new_tokens")
    (first_iteration, first_elapsed, first_model), (last_iteration, last_elapsed, last_model) = (
        marks[0],
        marks[-1],
    )
    return HostOverhead(
        last_iteration - first_iteration,
        stats.new_tokens,
        last_elapsed - first_elapsed,
        last_model - first_model,
        dict(stats.phase_s),
        stats.seed,
    )


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
