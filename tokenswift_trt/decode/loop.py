"""TokenSwift decoding and its AR baseline: the request's settings, its statistics and the loop.

The loop strings together the named stages of stages.py (propose -> build trie -> verify ->
accept -> commit) and, with tree="auto", asks the tuner (autotune.py) which plan to run; the
terms (root, draft, accepted and bonus tokens) are defined in stages.py.
"""

from __future__ import annotations

import random as random_module
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace

import torch

from tokenswift_trt.decode.admission import AdmissionError, admit, available_bytes, plan_memory
from tokenswift_trt.decode.autotune import AR_PLAN, IterationCosts, Plan, Tuner, probe_plan
from tokenswift_trt.decode.device_loop import DeviceLoop, run_device_loop
from tokenswift_trt.decode.ngram import NGRAM_LENGTH, NgramTable
from tokenswift_trt.decode.stages import (
    Acceptance,
    Acceptor,
    DecodeState,
    ForwardCall,
    NodeTargets,
    accept_trie,
    ar_step,
    candidates_from_hidden,
    commit,
    prefill,
    propose,
    retrieve_ngrams,
    retrieve_suffix,
    sample_next,
    verify,
)
from tokenswift_trt.decode.static_step import StaticForward, bucket_for
from tokenswift_trt.decode.suffix import LOOKUP_EVERY, MatchGate, SuffixIndex
from tokenswift_trt.decode.suffix import MAX_DEPTH as SUFFIX_MAX_DEPTH
from tokenswift_trt.decode.threads import ThreadGovernor
from tokenswift_trt.decode.tree import Trie, build_static_tree, build_trie, parse_tree
from tokenswift_trt.model.decoder import ForwardOutput, drafts_along_paths
from tokenswift_trt.model.draft_adaptation import AdaptationSettings, DraftAdapter
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.kv_cache import KVCache, PartialKVCache
from tokenswift_trt.model.sampling import (
    PositionKeyedRandom,
    RandomSource,
    SamplingConfig,
    TorchSampler,
    fused_sampler,
)
from tokenswift_trt.model.tensor_parallel import VocabParallelHead

METHODS = ("tokenswift", "ar")
AUTO = "auto"
DRAFT_SOURCES = (AUTO, "partial", "verify")


WINDOW_TOKENS = 256  # output positions per window of `Stats.windows`
MAX_TREE_NODES = 1024  # static tree nodes per verify pass (the paper's 1,3,3,3 has 41; --tree auto <= 41)


class GenerationError(ValueError):
    """A request that cannot run as given (the message says what to change)."""


class MemoryAdmissionError(GenerationError):
    """A request whose caches do not fit the memory budget (a scheduler keeps it queued until they do)."""


def check_tree_size(spec: str) -> None:
    """Refuse a static tree of more than MAX_TREE_NODES nodes from its spec alone (a 300,300 tree's
    mask would take gigabytes to build before any admission could count it)."""
    nodes, level = 1, 1
    for width in parse_tree(spec):
        level *= width
        nodes += level
    if nodes > MAX_TREE_NODES:
        raise GenerationError(
            f"tree {spec!r} has {nodes:,} nodes, more than the {MAX_TREE_NODES:,} one verify pass takes: "
            "give a smaller tree (e.g. 1,3,3,3) or the tree auto"
        )


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    method: str = "tokenswift"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # "auto": tuned to the machine while generating (autotune.py), every plan lossless;
    # "1,3,3,3" with ngram_topk 20 and the partial draft source is the paper's configuration
    tree: str = AUTO
    ngram_topk: int = 20  # ignored with tree="auto"
    kv_budget: int = 4096
    # recent region of the partial cache: committed tokens are appended there and the selection is
    # redone when it fills (None = B/4, the spec's); smaller = fresher selection, more selections
    kv_recent: int | None = None
    # "partial": the paper's separate draft forward of the root on the partial KV cache;
    # "verify": draft layers read the verify pass's hidden state of the last accepted token
    # (no draft forward, no partial cache; depth d of the tree uses draft layer d);
    # "auto": verify with tree="auto", partial with a static tree (`resolved_draft_source`)
    draft_source: str = AUTO
    seed: int | None = None
    ignore_eos: bool = False
    max_length: int | None = None  # engine maximum (prompt + generated); default: the model's
    prefill_chunk: int = 1024
    memory_budget: int | None = None  # bytes the caches may use; default: what is free now
    # fixed-shape steps over the whole cache (static_step.py), CUDA-graph captured on a GPU;
    # None = on for CUDA torch engines, off elsewhere
    static_steps: bool | None = None
    # the whole iteration on the device (device_loop.py), one CUDA graph per plan on a GPU; drafts
    # from the verify pass (the draft source it resolves to). None: on with CUDA where it runs
    # (`runs_device_loop`), the host loop elsewhere; False: the host loop
    device_loop: bool | None = None
    # fixed-shape steps through torch.compile (static_step.compiled_forward; implies static steps)
    compile_steps: bool = False
    # each request adapts its own copy of the draft layers to what it commits (model/draft_adaptation.py):
    # one optimiser step per `adapt_block` committed positions, over the newest `adapt_span`; off by
    # default: on a CPU a step costs more than it gains, on a GPU it is not measured yet
    # (docs/smollm2.md#draft-layers-that-keep-up); both the host loop and the device loop adapt
    adapt_drafts: bool = False
    adapt_block: int = 16
    adapt_span: int = 16  # each step trains on the newest this many committed positions
    adapt_scope: str = "all"  # "all": every draft-layer parameter; "layer1": layer 1 and the root input
    adapt_optimizer: str = "adam"  # "adam" or "sgd"
    adapt_lr: float | None = None  # None: 3e-4 with Adam, 3e-2 with SGD
    # layers with a draft vocabulary: "request" drafts over it plus the request's own tokens, "draft" over it
    adapt_vocab: str = "request"

    @property
    def resolved_draft_source(self) -> str:
        if self.draft_source != AUTO:
            return self.draft_source
        return "verify" if self.tree == AUTO or self.device_loop else "partial"

    @property
    def prefers_device_loop(self) -> bool:
        """Whether the device loop runs where it can (`runs_device_loop`): asked for, or left to the
        default while drafting from the verify pass."""
        if self.method != "tokenswift" or self.device_loop is False:
            return False
        return self.device_loop is True or self.resolved_draft_source == "verify"

    def runs_device_loop(self, engine: Engine, random: RandomSource) -> bool:
        """Whether this request runs the device loop on `engine`: as `device_loop` says, and where it is
        None on CUDA with a PyTorch engine whose iteration a graph can hold (position-keyed noise;
        draft layers without a path input, which draft level by level on the host). On a CPU the host
        loop is the default (docs/architecture.md)."""
        if not self.prefers_device_loop:
            return False
        if self.device_loop:
            return True
        return (
            engine.device.type == "cuda"
            and engine.model.fixed_shape_steps
            and isinstance(random, PositionKeyedRandom)
            and not drafts_along_paths(engine.draft_layers)
        )

    @property
    def adaptation(self) -> AdaptationSettings:
        return AdaptationSettings(
            block=self.adapt_block,
            span=self.adapt_span,
            scope=self.adapt_scope,
            optimizer=self.adapt_optimizer,
            lr=self.adapt_lr,
            vocab=self.adapt_vocab,
        )

    @property
    def adapts_drafts(self) -> bool:
        """Whether this request adapts its draft layers: as `adapt_drafts` says, for TokenSwift."""
        return self.adapt_drafts and self.method == "tokenswift"

    def validate(self) -> None:
        """Engine-independent checks; raise GenerationError naming the bad value."""
        try:
            self.sampling.validate()
            self.adaptation.validate()
            if self.tree != AUTO:
                check_tree_size(self.tree)  # counted from the spec before any tensor is built
                build_static_tree(self.tree)
        except ValueError as error:
            raise GenerationError(str(error)) from None
        if self.method not in METHODS:
            raise GenerationError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.draft_source not in DRAFT_SOURCES:
            raise GenerationError(
                f"draft source must be one of {', '.join(DRAFT_SOURCES)}, got {self.draft_source!r}"
            )
        if self.max_new_tokens <= 0:
            raise GenerationError(f"max new tokens must be positive, got {self.max_new_tokens}")
        if self.ngram_topk < 0:
            raise GenerationError(f"n-gram top-k must be >= 0, got {self.ngram_topk}")
        if self.kv_budget < 4:
            raise GenerationError(f"the partial KV budget must be at least 4, got {self.kv_budget}")
        if self.kv_recent is not None and not 1 <= self.kv_recent < self.kv_budget:
            raise GenerationError(
                f"the partial cache's recent region must be in [1, {self.kv_budget}) (below the "
                f"budget), got {self.kv_recent}"
            )
        if self.max_length is not None and self.max_length < 2:
            raise GenerationError(
                f"max length must be at least 2 (a prompt token and a new one), got {self.max_length}: "
                "leave it out for the model's"
            )
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise GenerationError(f"the memory budget must be positive, got {self.memory_budget} bytes")
        if self.prefill_chunk < 1:
            raise GenerationError(f"prefill chunk must be positive, got {self.prefill_chunk}")
        if self.compile_steps and self.static_steps is False:
            raise GenerationError("compiled steps are fixed-shape steps: they need static steps on")
        if self.device_loop and self.method == "tokenswift":
            if self.resolved_draft_source != "verify":
                raise GenerationError(
                    "the device loop drafts from the verify pass: use --draft-source verify, or drop "
                    "--device-loop for partial-cache drafting (the host loop's)"
                )


def _count_depths(reached: list[int], accepted_by_depth: list[int], offered: int, accepted: int) -> None:
    """One iteration offering drafts `offered` levels deep, of which the walk accepted `accepted`."""
    for lists in (reached, accepted_by_depth):
        lists.extend([0] * (offered - len(lists)))
    for depth in range(min(offered, accepted + 1)):
        reached[depth] += 1
        accepted_by_depth[depth] += depth < accepted


@dataclass
class Window:
    """The iterations whose first committed token lies at output positions [start, start + size) of
    the generated text (position 0 is the prefill's token, committed by no iteration); an iteration
    that crosses the window's end counts whole in the window where it began. An AR step is an
    iteration of one token with nothing drafted."""

    start: int
    size: int
    iterations: int = 0
    tokens: int = 0  # committed by those iterations: accepted drafts + the bonus token
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    ngram_accepted_tokens: int = 0
    reached_by_depth: list[int] = field(default_factory=list)  # as `Stats.reached_by_depth`
    accepted_by_depth: list[int] = field(default_factory=list)

    def add(self, other: Window) -> None:
        """Sum another run's counts of the same window into this one."""
        self.iterations += other.iterations
        self.tokens += other.tokens
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        self.ngram_accepted_tokens += other.ngram_accepted_tokens
        for counts, more in (
            (self.reached_by_depth, other.reached_by_depth),
            (self.accepted_by_depth, other.accepted_by_depth),
        ):
            counts.extend([0] * (len(more) - len(counts)))
            for depth, count in enumerate(more):
                counts[depth] += count

    def copy(self) -> Window:
        return replace(
            self, reached_by_depth=list(self.reached_by_depth), accepted_by_depth=list(self.accepted_by_depth)
        )

    def figures(self) -> dict:
        """The window's counts and what they give: α, β, α by depth, tokens per iteration."""
        return {
            "start": self.start,
            "end": self.start + self.size,
            "iterations": self.iterations,
            "tokens": self.tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "ngram_accepted_tokens": self.ngram_accepted_tokens,
            "reached_by_depth": list(self.reached_by_depth),
            "accepted_by_depth": list(self.accepted_by_depth),
            "alpha": self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            "beta": self.ngram_accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            "alpha_by_depth": [
                a / r if r else 0.0 for a, r in zip(self.accepted_by_depth, self.reached_by_depth)
            ],
            "tokens_per_iteration": self.tokens / self.iterations if self.iterations else 0.0,
        }


@dataclass
class Stats:
    method: str
    seed: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    iterations: int = 0  # decode iterations (AR: steps)
    forwards: int = 0  # decode forward passes: AR steps, draft passes, verify passes (timing probes excluded)
    branch_iterations: int = 0  # between the tuner's AR steps: verifies of a long match's branch alone
    drafted_tokens: int = 0  # per iteration, the trie's depth (the longest draft offered)
    accepted_tokens: int = 0
    ngram_accepted_tokens: int = 0  # accepted nodes that only an n-gram branch proposed
    ngram_hit_iterations: int = 0
    partial_selections: int = 0
    fixed_shape_steps: int = 0  # forwards run by StaticForward (static_steps), eager or replayed
    graph_replays: int = 0  # of those, CUDA-graph replays
    graph_captures: int = 0
    plans: list[Plan] = field(default_factory=list)  # tree="auto": the plans run, in order
    # per draft depth d (index d - 1): iterations whose walk reached depth d - 1 with a draft at depth d
    # offered, and those that accepted it (α by depth = accepted / reached)
    reached_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    # the same figures per window of `window_tokens` output positions (`Window`), window k at index k
    window_tokens: int = WINDOW_TOKENS
    windows: list[Window] = field(default_factory=list)
    prefill_s: float = 0.0
    elapsed_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""
    draft_updates: int = 0  # optimiser steps of the request's draft layers (adapt_drafts)
    thread_switches: int = 0  # times the CPU thread count changed (decode/threads.py)

    @property
    def acceptance_rate(self) -> float:
        """α = accepted draft tokens / drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """α at each draft depth: of the iterations that accepted every depth before it and offered a
        draft there, the share that accepted that depth too."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_by_depth, self.reached_by_depth)]

    def count_depths(self, offered: int, accepted: int) -> None:
        """One iteration offering drafts `offered` levels deep, of which the walk accepted `accepted`."""
        _count_depths(self.reached_by_depth, self.accepted_by_depth, offered, accepted)

    def count_window(
        self, position: int, tokens: int, offered: int = 0, accepted: int = 0, ngram_accepted: int = 0
    ) -> None:
        """One iteration in its window: its first committed token at output `position`, `tokens`
        committed, drafts `offered` levels deep (the drafted tokens), `accepted` of them accepted,
        `ngram_accepted` of those only along n-gram branches (an AR step: `tokens` 1, the rest 0)."""
        index = position // self.window_tokens
        while len(self.windows) <= index:
            self.windows.append(Window(len(self.windows) * self.window_tokens, self.window_tokens))
        window = self.windows[index]
        window.iterations += 1
        window.tokens += tokens
        window.drafted_tokens += offered
        window.accepted_tokens += accepted
        window.ngram_accepted_tokens += ngram_accepted
        if offered:
            _count_depths(window.reached_by_depth, window.accepted_by_depth, offered, accepted)

    def count_drafting(
        self, position: int, tokens: int, offered: int, accepted: int, ngram_accepted: int
    ) -> None:
        """One drafting iteration in the totals, by depth and in its window (`count_window`'s terms)."""
        self.drafted_tokens += offered
        self.accepted_tokens += accepted
        self.count_depths(offered, accepted)
        self.ngram_accepted_tokens += ngram_accepted
        self.ngram_hit_iterations += ngram_accepted > 0
        self.count_window(position, tokens, offered, accepted, ngram_accepted)

    @property
    def window_figures(self) -> list[dict]:
        """Per window of output positions: α by depth, tokens per iteration and their counts
        (`Window.figures`), in order of position."""
        return [window.figures() for window in self.windows]

    @property
    def ngram_acceptance_rate(self) -> float:
        """β = draft tokens accepted along an n-gram branch / drafted tokens."""
        return self.ngram_accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per decode forward pass (the first token comes from the prefill): above 1 is
        what any speedup must come from where a forward's cost does not grow with its tokens."""
        return (self.new_tokens - 1) / self.forwards if self.forwards else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens committed per iteration (accepted + 1)."""
        return 1 + self.accepted_tokens / self.iterations if self.iterations else 0.0

    def add_time(self, phase: str, seconds: float) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds


def _check_request(engine: Engine, prompt: Sequence[int], config: GenerationConfig) -> int:
    config.validate()
    if not prompt:
        raise GenerationError("the prompt is empty: give at least one token")
    vocab = engine.config.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise GenerationError(f"prompt token ids must be in [0, {vocab})")
    max_length = config.max_length or engine.config.max_position_embeddings
    if len(prompt) >= max_length:
        raise GenerationError(
            f"the prompt has {len(prompt)} tokens but the engine's maximum length is {max_length}: "
            "shorten the prompt"
        )
    return max_length


DecodeSteps = Generator[Stats, None, tuple[list[int], Stats]]  # yields live Stats, returns (new ids, Stats)


def generate(
    engine: Engine,
    prompt: Sequence[int],
    config: GenerationConfig,
    on_tokens: Callable[[list[int]], None] | None = None,
    random: RandomSource | None = None,
    acceptor: Acceptor = accept_trie,
    observer: Callable[[Stats], None] | None = None,
    window_tokens: int = WINDOW_TOKENS,
) -> tuple[list[int], Stats]:
    """Generate after `prompt`; returns the new token ids and `Stats`.

    Stops at max_new_tokens, at an EOS token unless ignore_eos, or at the engine's maximum length
    (stop_reason says which). `on_tokens` receives each batch of newly committed tokens;
    `observer` sees the live Stats after every iteration (new_tokens and elapsed_s current).
    `config.tree == "auto"` tunes the tree and n-gram k while generating (decode/autotune.py).
    `window_tokens`: output positions per window of `Stats.windows` (figures by position).
    """
    steps = decode_steps(engine, prompt, config, on_tokens, random, acceptor, window_tokens)
    while True:
        try:
            stats = next(steps)
        except StopIteration as finished:
            return finished.value
        if observer:
            observer(stats)


RequestSteps = Generator[Stats | ForwardCall, None, tuple[list[int], Stats]]


@torch.inference_mode()
def decode_steps(
    engine: Engine,
    prompt: Sequence[int],
    config: GenerationConfig,
    on_tokens: Callable[[list[int]], None] | None = None,
    random: RandomSource | None = None,
    acceptor: Acceptor = accept_trie,
    window_tokens: int = WINDOW_TOKENS,
) -> DecodeSteps:
    """`generate` one iteration at a time: yields the live Stats after every iteration and returns
    (new token ids, Stats) when done. Nothing runs between yields, so callers can interleave several
    generations and time each on its own clock (the bench does, so that drift hits all alike).
    The request runs alone: each forward it asks for runs at once; on a CPU its thread count follows
    what is fastest on the machine now (decode/threads.py)."""
    steps = run_alone(
        engine, request_steps(engine, prompt, config, on_tokens, random, acceptor, window_tokens)
    )
    governor = ThreadGovernor.for_setting(engine.kernels.threads) if engine.device.type == "cpu" else None
    if governor is None:
        return (yield from steps)
    result = yield from governor.run(steps, lambda live: live.new_tokens)
    result[1].thread_switches = governor.switches
    return result


def run_alone(engine: Engine, steps: RequestSteps) -> DecodeSteps:
    """A request's steps with every forward it asks for run at once, alone: yields its Stats only."""
    sent = None
    while True:
        try:
            item = steps.send(sent)
        except StopIteration as finished:
            return finished.value
        if isinstance(item, ForwardCall):
            item.run_alone(engine)
        else:
            yield item


@torch.inference_mode()
def request_steps(
    engine: Engine,
    prompt: Sequence[int],
    config: GenerationConfig,
    on_tokens: Callable[[list[int]], None] | None = None,
    random: RandomSource | None = None,
    acceptor: Acceptor = accept_trie,
    window_tokens: int = WINDOW_TOKENS,
) -> RequestSteps:
    """One request's generation as a driver runs it: the prompt's prefill at the first resume, then
    the iterations; yields a `ForwardCall` wherever an iteration needs a forward on the full cache
    (the driver sets its output before resuming: `run_alone` at once, the scheduler batched with
    other requests') and the live Stats after every iteration; returns (new ids, Stats)."""
    if window_tokens < 1:
        raise GenerationError(f"the statistics window must be at least 1 token, got {window_tokens}")
    seed = config.seed if config.seed is not None else random_module.SystemRandom().randrange(2**63)
    state = new_decode_state(engine, prompt, config, random or PositionKeyedRandom(seed))
    stats = Stats(method=config.method, seed=seed, prompt_tokens=len(prompt), window_tokens=window_tokens)
    adapter = None
    if config.adapts_drafts:  # the request's own copy of the layers, adapted as it goes
        adapter = new_adapter(engine, state, config)
        engine = replace(engine, draft_layers=adapter.layers)
    started = time.perf_counter()
    try:
        hidden = prefill(engine, state, prompt, config.prefill_chunk)
        first = sample_next(engine, state, hidden)
        state.append([first])
        if adapter is not None:  # drafted from now on, as the prompt's tokens are
            adapter.admit([first])
        stats.prefill_s = time.perf_counter() - started
        if on_tokens:
            on_tokens([first])
        if first not in state.stop_tokens and len(state.tokens) < state.limit:
            if config.method == "ar":
                yield from _ar_loop(engine, state, stats, started, on_tokens)
            elif config.runs_device_loop(engine, state.random):
                yield from _device_loop(engine, state, config, stats, started, hidden, on_tokens, adapter)
            else:
                _refresh_drafting_state(state)  # the partial cache's first selection, the prompt's n-grams
                yield from _tokenswift_loop(
                    engine, state, config, stats, started, hidden, on_tokens, acceptor, adapter
                )
    finally:  # also when the caller stops early: no step may still run on memory about to go
        if adapter is not None:
            adapter.finish()
    return _finish(state, config, stats, started)


def new_adapter(engine: Engine, state: DecodeState, config: GenerationConfig) -> DraftAdapter:
    """A `DraftAdapter` over a copy of the engine's draft layers, reading the request's history."""
    return engine_adapter(engine, state.history, len(state.tokens), config.sampling, config.adaptation)


def engine_adapter(
    engine: Engine,
    history: torch.Tensor,  # [capacity] ids: the prompt, then what is committed
    used: int,  # ids of `history` already there (the prompt's): drafted from the start
    sampling: SamplingConfig,
    settings: AdaptationSettings,
) -> DraftAdapter:
    """A `DraftAdapter` over a copy of the engine's draft layers and its frozen LM head, embedding and
    final norm, reading `history`."""
    model = engine.model.torch_model
    if isinstance(model.lm_head, VocabParallelHead):  # the adapter's loss reads every row of the head
        raise GenerationError(
            "draft adaptation needs the whole LM head on every rank: drop --adapt-drafts, or run --tp "
            "with the replicated head"
        )
    adapter = DraftAdapter(
        engine.draft_layers,
        engine.config,
        model.model.embed_tokens.weight,
        model.lm_head.weight,
        model.model.norm,
        history,
        sampling,
        settings,
        engine.kernels,
    )
    adapter.admit(history[:used].tolist())
    return adapter


def new_decode_state(
    engine: Engine, prompt: Sequence[int], config: GenerationConfig, random: RandomSource
) -> DecodeState:
    """Check the request and allocate everything the sequence needs (caches, n-gram table, buffers)."""
    max_length = _check_request(engine, prompt, config)
    drafting = config.method == "tokenswift"
    from_verify = config.resolved_draft_source == "verify"
    auto = config.tree == AUTO
    probe_tree, probe_topk = probe_plan(config.resolved_draft_source, engine.device)
    tree = build_static_tree(probe_tree if auto else config.tree)
    max_depth = len(engine.draft_layers) + (0 if from_verify else 1)
    if drafting and tree.depth > max_depth:
        raise GenerationError(
            f"tree {config.tree!r} is {tree.depth} deep but the engine has {len(engine.draft_layers)} "
            "draft layers "
            f"(at most {max_depth} levels when drafting from the {config.resolved_draft_source} pass)"
        )
    ngram_topk = (probe_topk if auto else config.ngram_topk) if drafting else 0
    limit = min(len(prompt) + config.max_new_tokens, max_length)
    # long matches (suffix.py) wherever n-grams are reused: a branch is offered only where the text's
    # last 8+ tokens occurred before, which a penalty makes rarer but does not rule out
    long_matches = ngram_topk > 0
    max_trie = (
        tree.num_nodes + ngram_topk * tree.branching[0] * NGRAM_LENGTH + long_matches * SUFFIX_MAX_DEPTH
    )
    cfg, dtype, device = engine.config, engine.dtype, engine.device
    static = config.static_steps if config.static_steps is not None else device.type == "cuda"
    static = static or config.compile_steps
    if config.compile_steps and not engine.model.fixed_shape_steps:
        raise GenerationError("--compile-steps compiles PyTorch engines: drop it for this engine")
    static = static and engine.model.fixed_shape_steps  # exported graphs (onnx, TensorRT) have their own
    max_trie = bucket_for(max_trie) if static else max_trie  # slots a padded forward writes
    with_partial = drafting and not from_verify
    plan = plan_memory(engine, limit + max_trie, config.kv_budget if with_partial else 0, max_trie)
    try:
        admit(plan, config.memory_budget if config.memory_budget is not None else available_bytes(device))
    except AdmissionError as error:
        if plan.tree_bytes > plan.full_cache_bytes + plan.partial_cache_bytes:
            tree_name = "auto's probe tree" if auto else f"tree {config.tree!r}"
            fix = "a larger memory budget" if auto else "a smaller tree or n-gram top-k, or the tree auto"
            raise MemoryAdmissionError(
                f"{error}; most of it is the tree buffers ({max_trie:,} nodes: {tree_name} and "
                f"{ngram_topk} n-gram branches): give {fix}"
            ) from None
        raise MemoryAdmissionError(str(error)) from None
    full = KVCache(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, limit + max_trie, dtype, device, engine.kernels
    )
    partial = (
        PartialKVCache(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            config.kv_budget,
            recent=config.kv_recent,
            dtype=dtype,
            device=device,
            longest=limit,
        )
        if with_partial
        else None
    )
    history = torch.zeros(limit + max_trie, dtype=torch.long, device=device)
    history[: len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
    compiled = config.compile_steps
    static_full = (
        StaticForward(engine.model.torch_model, full, capture=device.type == "cuda", compiled=compiled)
        if static
        else None
    )
    return DecodeState(
        tokens=list(prompt),
        history=history,
        prompt_length=len(prompt),
        limit=limit,
        full=full,
        partial=partial,
        table=NgramTable(NGRAM_LENGTH) if ngram_topk > 0 else None,
        random=random,
        sampling=config.sampling,
        stop_tokens=frozenset() if config.ignore_eos else frozenset(cfg.eos_token_ids),
        sampler=fused_sampler(config.sampling, device, dtype, engine.kernels)
        or TorchSampler(config.sampling),
        ngram_exclusion=config.sampling.penalty_window if config.sampling.penalty > 1 else 0,
        suffix=SuffixIndex() if long_matches else None,
        static_full=static_full,
        static_partial=StaticForward(
            engine.model.torch_model, partial, capture=static_full.capture, compiled=compiled
        )
        if static_full is not None and partial is not None
        else None,
        needed_bytes=plan.needed_bytes,
    )


def _finish(
    state: DecodeState, config: GenerationConfig, stats: Stats, started: float
) -> tuple[list[int], Stats]:
    stats.elapsed_s = time.perf_counter() - started
    for runner in (state.static_full, state.static_partial):
        if runner is not None:
            stats.fixed_shape_steps += runner.counters.eager_runs + runner.counters.graph_replays
            stats.graph_replays += runner.counters.graph_replays
            stats.graph_captures += runner.counters.captures
    stats.partial_selections = state.partial.selections if state.partial is not None else 0
    new_tokens = state.tokens[state.prompt_length :]
    stats.new_tokens = len(new_tokens)
    if new_tokens[-1] in state.stop_tokens:
        stats.stop_reason = "eos"
    elif len(new_tokens) >= config.max_new_tokens:
        stats.stop_reason = "max_new_tokens"
    else:
        stats.stop_reason = "max_length"
    return new_tokens, stats


def _ar_loop(
    engine: Engine,
    state: DecodeState,
    stats: Stats,
    started: float,
    on_tokens: Callable[[list[int]], None] | None,
) -> RequestSteps:
    yield from _ar_steps(engine, state, stats, started, on_tokens, state.limit, "forward")


def _ar_steps(
    engine: Engine,
    state: DecodeState,
    stats: Stats,
    started: float,
    on_tokens: Callable[[list[int]], None] | None,
    steps: int,
    phase: str,
    look: Callable[[], list[int]] | None = None,
    every: int = LOOKUP_EVERY,
) -> Generator[Stats | ForwardCall, None, ArSteps]:
    """Up to `steps` plain AR steps (`--method ar`'s loop; `--tree auto` runs the same between its
    decisions), ending early at a stop token or the limit, or where `look` (asked every `every` steps)
    finds a long match's branch; returns what the tuner needs of them, and that branch."""
    out, seconds, count, done, branch = None, 0.0, 0, False, []
    while not done and count < steps and not branch:
        tick = time.perf_counter()
        out = yield from ar_step(engine, state)
        token = state.tokens[-1]
        stats.iterations += 1
        stats.forwards += 1
        step_s = time.perf_counter() - tick
        stats.add_time(phase, step_s)
        stats.new_tokens, stats.elapsed_s = (
            len(state.tokens) - state.prompt_length,
            time.perf_counter() - started,
        )
        stats.count_window(stats.new_tokens - 1, 1)
        if on_tokens:
            on_tokens([token])
        yield stats
        seconds, count = seconds + step_s, count + 1
        done = token in state.stop_tokens or len(state.tokens) >= state.limit
        if look is not None and count % every == 0 and not done:
            branch = look()
    assert out is not None
    return ArSteps(out, seconds, count, done, branch)


def _branch_iteration(
    engine: Engine, state: DecodeState, branch: list[int], acceptor: Acceptor, stats: Stats, position: int
) -> Generator[ForwardCall, None, tuple[Acceptance, torch.Tensor]]:
    """One iteration between AR steps whose trie is the root and a long match's branch alone (no
    drafts); returns its acceptance and the hidden state [hidden] of its last accepted node."""
    trie = Trie(state.tokens[-1])
    trie.add_path(branch, from_tree=False, ngram_rank=0)
    tick = time.perf_counter()
    verified = yield from verify(engine, state, trie)
    targets = NodeTargets(engine, state, trie, verified.hidden)
    acceptance = acceptor(trie, targets, state.limit - len(state.tokens), state.stop_tokens)
    commit(state, acceptance, verified)
    stats.add_time("branch_step", time.perf_counter() - tick)
    _count_drafts(stats, trie, acceptance, 1, position)
    stats.branch_iterations += 1
    return acceptance, verified.hidden[acceptance.nodes[-1] if acceptance.nodes else 0]


@dataclass
class ArSteps:
    """A run of plain AR steps (`_ar_steps`): the last one's forward, their seconds, count and whether
    the generation ended."""

    out: ForwardOutput
    seconds: float
    steps: int
    done: bool
    branch: list[int] = field(default_factory=list)  # a long match's branch found after the last step


def _tokenswift_loop(
    engine: Engine,
    state: DecodeState,
    config: GenerationConfig,
    stats: Stats,
    started: float,
    last_hidden: torch.Tensor,  # [hidden] of the last committed token (drafting from the verify pass)
    on_tokens: Callable[[list[int]], None] | None,
    acceptor: Acceptor,
    adapter: DraftAdapter | None = None,
) -> Generator[Stats | ForwardCall, None, None]:
    """Iterations of propose -> build trie -> verify -> accept -> commit, under a fixed plan or the
    tuner's; `adapter` adapts the draft layers (`engine.draft_layers`, its copy) from every commit."""
    from_verify = config.resolved_draft_source == "verify"
    new_tokens = lambda: len(state.tokens) - state.prompt_length  # noqa: E731
    tuner = (
        Tuner(engine, state, from_verify, state.full.capacity - state.limit, new_tokens)
        if config.tree == AUTO
        else None
    )
    plan = tuner.plan if tuner is not None else Plan(config.tree, config.ngram_topk)
    if tuner is not None:
        stats.plans = tuner.history
    tree = plan.static_tree()
    last_draft_logits: torch.Tensor | None = (
        None  # [depth, V] at the last committed token, from the verify pass
    )
    drafting_state_stale = False  # AR steps skip the partial cache and n-gram table upkeep
    gate = MatchGate()  # long matches between the tuner's AR steps
    branch_before = False  # the last iteration verified a long match's branch between AR steps

    def look() -> list[int]:
        """A long match's branch to verify between AR steps, where the gate is open; [] otherwise."""
        return retrieve_suffix(state, state.limit - len(state.tokens)) if gate.open(new_tokens()) else []

    done = False
    while not done:
        tick = time.perf_counter()
        position = new_tokens()  # of this iteration's first committed token
        trie, costs = None, None
        if tuner is not None and (steps := tuner.plain_ar_steps()):
            # the tuner settled on AR steps: `--method ar`'s loop, no per-token bookkeeping, until
            # its next decision or a long match worth verifying; the tuner hears of them once. Right
            # after a branch iteration the text likely goes on repeating: look at once
            branch = look() if branch_before else []
            if not branch:
                watch = look if state.suffix is not None else None
                every = gate.every(new_tokens())
                run = yield from _ar_steps(
                    engine, state, stats, started, on_tokens, steps, "ar_step", watch, every
                )
                gate.ar_run(run.seconds, run.steps)
                assert run.out.queries is not None
                state.queries, last_hidden, last_draft_logits = (
                    [q[-1] for q in run.out.queries],
                    run.out.hidden[0],
                    None,
                )
                drafting_state_stale, done = True, run.done
                next_plan = tuner.observe(None, [], None, last_hidden, done, run.seconds, run.steps)
                if next_plan is not plan:
                    plan, tree = next_plan, next_plan.static_tree()
                branch = run.branch
            branch_before = bool(branch) and not done and bool(tuner.plain_ar_steps())
            if not branch_before:
                continue
            # the text repeats: verify what followed its earlier occurrence, the branch alone; the
            # tuner hears of it as of AR steps (no trie of its plans)
            tick, position = time.perf_counter(), new_tokens()
            acceptance, last_hidden = yield from _branch_iteration(
                engine, state, branch, acceptor, stats, position
            )
            gate.branch_run(position, time.perf_counter() - tick, len(acceptance.tokens))
            last_draft_logits, drafting_state_stale = None, True
        elif tree is None:  # a plain AR step, the same code as the AR baseline's
            out = yield from ar_step(engine, state)
            assert out.queries is not None
            state.queries, last_hidden, last_draft_logits = [q[-1] for q in out.queries], out.hidden[0], None
            acceptance = Acceptance(nodes=[], tokens=state.tokens[-1:])
            drafting_state_stale = True
            stats.add_time("ar_step", time.perf_counter() - tick)
            stats.forwards += 1
            stats.count_window(position, 1)
        else:
            if drafting_state_stale:  # catch up after AR steps: reselect the partial cache, count the n-grams
                _refresh_drafting_state(state)
                drafting_state_stale = False
                tick = time.perf_counter()
            # propose
            if from_verify:
                candidates = candidates_from_hidden(engine, state, last_hidden, tree, last_draft_logits)
            else:
                candidates = propose(engine, state, tree)
            t_draft = time.perf_counter()
            # build trie: head 0's candidates key the n-grams; drafting from the verify pass, that is the root
            keys = [state.tokens[-1]] if from_verify else candidates[0]
            ngrams = retrieve_ngrams(state, keys, plan.ngram_topk)
            trie = build_trie(state.tokens[-1], tree, candidates, ngrams, from_verify)
            long_match = retrieve_suffix(state, state.limit - len(state.tokens)) if plan.ngram_topk else []
            if long_match:  # the text repeats: what followed its earlier occurrence, as deep as it matched;
                # offered with any k >= 1, as the best 4-gram is: the tuner prices it as rank 0
                trie.add_path(long_match, from_tree=False, ngram_rank=0)
            t_trie = time.perf_counter()
            # verify
            verified = yield from verify(engine, state, trie)
            t_verify = time.perf_counter()
            # accept
            targets = NodeTargets(engine, state, trie, verified.hidden, tree.depth if from_verify else 0)
            acceptance = acceptor(trie, targets, state.limit - len(state.tokens), state.stop_tokens)
            t_accept = time.perf_counter()
            # commit
            root_position = state.root_position
            commit(state, acceptance, verified)
            last_node = acceptance.nodes[-1] if acceptance.nodes else 0
            last_hidden, last_draft_logits = verified.hidden[last_node], targets.draft_logits(last_node)
            t_commit = time.perf_counter()
            for phase, begin, end in (
                ("draft", tick, t_draft),
                ("trie", t_draft, t_trie),
                ("verify", t_trie, t_verify),
                ("accept", t_verify, t_accept),
                ("commit", t_accept, t_commit),
            ):
                stats.add_time(phase, end - begin)
            costs = IterationCosts(t_draft - tick, t_trie - t_draft, t_commit - t_accept, len(trie))
            if adapter is not None:  # the root's and the accepted nodes' states: committed positions
                kept = verified.hidden[[0, *acceptance.nodes]]  # [1 + accepted, hidden]
                after = state.tokens[root_position + 1 : root_position + 1 + kept.shape[0]]
                stats.add_time("adapt", adapter.observe(root_position, kept, after))
                stats.draft_updates = adapter.updates
            _count_drafts(stats, trie, acceptance, 1 if from_verify else 2, position)
        iteration_s = time.perf_counter() - tick
        stats.iterations += 1
        stats.new_tokens, stats.elapsed_s = new_tokens(), time.perf_counter() - started
        if on_tokens:
            on_tokens(acceptance.tokens)
        yield stats
        done = acceptance.tokens[-1] in state.stop_tokens or len(state.tokens) >= state.limit
        if tuner is not None:
            next_plan = tuner.observe(
                trie, acceptance.nodes, costs, last_hidden, done, iteration_s, len(acceptance.tokens)
            )
            if next_plan is not plan:
                plan, tree = next_plan, next_plan.static_tree()


def _device_loop(
    engine: Engine,
    state: DecodeState,
    config: GenerationConfig,
    stats: Stats,
    started: float,
    last_hidden: torch.Tensor,  # [hidden] of the last committed token
    on_tokens: Callable[[list[int]], None] | None,
    adapter: DraftAdapter | None = None,
) -> Generator[Stats | ForwardCall, None, None]:
    """Iterations run by device_loop.py under a fixed plan or the tuner's: its drafting plans on the
    device, each captured once as its own graph (the host reads each iteration's report, one
    iteration late), its AR steps as `--method ar` runs them. A plan the tuner leaves stops after the
    iteration already queued, which commits but is not reported to the tuner. `adapter` adapts the
    draft layers (`engine.draft_layers`, its copy) from each iteration the host has read."""
    if not engine.model.fixed_shape_steps:
        raise GenerationError("the device loop runs PyTorch engines: drop --device-loop for this engine")
    capture = engine.device.type == "cuda"
    new_tokens = lambda: len(state.tokens) - state.prompt_length  # noqa: E731
    auto = config.tree == AUTO
    tuner = Tuner(engine, state, True, state.full.capacity - state.limit, new_tokens) if auto else None
    plan = tuner.plan if tuner is not None else Plan(config.tree, config.ngram_topk)
    largest, topk = probe_plan("verify", engine.device) if auto else (config.tree, config.ngram_topk)
    try:
        depth = min(len(parse_tree(largest)), len(engine.draft_layers))  # the tuner's plans are no deeper
        loop = DeviceLoop(engine, state, depth, topk, capture, config.compile_steps, adapter)
    except ValueError as error:
        raise GenerationError(str(error)) from None
    if tuner is not None:
        stats.plans = tuner.history
    done = False
    while not done:
        if plan.tree == AR_PLAN:  # the tuner's AR steps
            assert tuner is not None
            steps = max(1, tuner.plain_ar_steps())
            run = yield from _ar_steps(engine, state, stats, started, on_tokens, steps, "ar_step")
            last_hidden, done = run.out.hidden[0], run.done
            plan = tuner.observe(None, [], None, last_hidden, done, run.seconds, run.steps)
            continue
        executor = loop.plan(plan.static_tree(), plan.ngram_topk)  # type: ignore[arg-type]
        loop.enter(last_hidden)
        loop.prepare(executor)  # a new plan's graph is captured before its iterations are timed
        tick = time.perf_counter()
        for report in run_device_loop(loop, executor, stats.add_time):
            position = new_tokens()  # of this iteration's first committed token
            root_position = len(state.tokens) - 1
            state.tokens.extend(report.tokens)
            if adapter is not None and report.tokens:  # the root's and the accepted slots' states
                kept = loop.committed_hidden(root_position, len(report.tokens))  # [committed, hidden]
                stats.add_time("adapt", adapter.observe(root_position, kept, report.tokens))
                stats.draft_updates = adapter.updates
            stats.iterations += 1
            stats.forwards += 1
            stats.count_drafting(
                position, len(report.tokens), report.offered, report.accepted, report.ngram_accepted
            )
            stats.new_tokens, stats.elapsed_s = new_tokens(), time.perf_counter() - started
            if on_tokens and report.tokens:
                on_tokens(report.tokens)
            yield stats
            done, now = report.done, time.perf_counter()
            seconds, tick = now - tick, now
            if tuner is not None and not report.drained:
                features = executor.features(report)
                next_plan = tuner.observe(
                    features, report.chain, None, loop.last_hidden, done, seconds, len(report.tokens)
                )
                if next_plan is not plan:
                    plan = next_plan
                    loop.halt()
        last_hidden = loop.leave()
    stats.graph_replays += loop.replays
    stats.graph_captures += loop.captures


def _refresh_drafting_state(state: DecodeState) -> None:
    if state.partial is not None:
        state.partial.select(state.full, state.queries)
    if state.table is not None:
        state.table.update(state.tokens, len(state.tokens) - state.ngram_exclusion)


def _count_drafts(stats: Stats, trie, acceptance: Acceptance, forwards: int, position: int) -> None:
    stats.forwards += forwards  # verify (+ the draft pass)
    offered = max(trie.depths)  # the longest draft offered (n-gram branches may pass the tree)
    ngram_accepted = sum(1 for node in acceptance.nodes if not trie.from_tree[node])
    stats.count_drafting(position, len(acceptance.tokens), offered, len(acceptance.nodes), ngram_accepted)
