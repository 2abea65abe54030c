"""TokenSwift decoding and its AR baseline, as named stages and a short loop.

Terms (one iteration):
- root token: the last sampled token; committed as output but not yet in the KV cache.
- draft tokens: the trie's nodes below the root (static tree from the draft heads + n-grams).
- accepted tokens: draft tokens the target itself produced at their position, walking from the
  root; `accept_length` = how many.
- bonus token: the target's sample after the last accepted node; it becomes the next root.
Every iteration therefore commits accept_length + 1 tokens.

Stages: propose (draft forward on the partial cache -> per-head candidates, n-gram branches)
-> build trie -> verify (one forward over the trie on the full cache) -> accept -> commit
(full cache, partial cache, n-gram table, token history). With draft_source="verify" the
candidates come from the last verify pass instead of a separate draft forward; with
tree="auto" the tree and n-gram k are tuned while generating (autotune.py).
"""

from __future__ import annotations

import random as random_module
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from .admission import AdmissionError, admit, available_bytes, plan_memory
from .autotune import AR_PLAN, PROBE_TOPK, PROBE_TREE, ProbeRecorder, choose_plan, time_verify
from .engine import Engine
from .kv_cache import KVCache, PartialKVCache
from .model import ForwardOutput, LlamaModel
from .ngram import NgramTable
from .sampling import (
    PositionKeyedRandom, RandomSource, Sampler, SamplingConfig, TorchSampler, fused_sampler,
)
from .static_step import StaticForward, bucket_for
from .transfer import copy_from_host, to_device
from .tree import StaticTree, Trie, build_static_tree, build_trie

METHODS = ("tokenswift", "ar")
NGRAM_LENGTH = 4
AUTO = "auto"
DRAFT_SOURCES = ("partial", "verify")
VERIFY_PROBE_TREE = "3,3,3"  # drafting from the verify pass: depth d uses draft layer d
PROBE_ITERATIONS = 32  # tree tuning: probe iterations with the largest tree (acceptance counts add up over probes)
RETUNE_EVERY = 4096  # tree tuning: probe again after this many new tokens
RETUNE_AFTER_AR = 1024  # ... or this many after choosing plain AR steps (which teach the tuner nothing)
BATCHED_NODES_MAX = 16  # on a CPU, tries up to this size sample every node in one batch (NodeTargets)


class GenerationError(ValueError):
    """A request that cannot run as given (the message says what to change)."""


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    method: str = "tokenswift"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tree: str = "1,3,3,3"  # or "auto"
    ngram_topk: int = 20  # ignored with tree="auto"
    kv_budget: int = 4096
    # recent region of the partial cache: committed tokens are appended there and the selection is
    # redone when it fills (None = B/4, the spec's); smaller = fresher selection, more selections
    kv_recent: int | None = None
    # "partial": the paper's separate draft forward of the root on the partial KV cache;
    # "verify": draft layers read the verify pass's hidden state of the last accepted token
    # (no draft forward, no partial cache; depth d of the tree uses draft layer d)
    draft_source: str = "partial"
    seed: int | None = None
    ignore_eos: bool = False
    max_length: int | None = None  # engine maximum (prompt + generated); default: the model's
    prefill_chunk: int = 1024
    memory_budget: int | None = None  # bytes the caches may use; default: what is free now
    # fixed-shape steps over the whole cache (static_step.py), CUDA-graph captured on a GPU;
    # None = on for CUDA torch engines, off elsewhere
    static_steps: bool | None = None

    def validate(self) -> None:
        """Engine-independent checks; raise GenerationError naming the bad value."""
        try:
            self.sampling.validate()
            if self.tree != AUTO:
                build_static_tree(self.tree)
        except ValueError as error:
            raise GenerationError(str(error)) from None
        if self.method not in METHODS:
            raise GenerationError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.draft_source not in DRAFT_SOURCES:
            raise GenerationError(f"draft source must be one of {', '.join(DRAFT_SOURCES)}, got {self.draft_source!r}")
        if self.max_new_tokens <= 0:
            raise GenerationError(f"max new tokens must be positive, got {self.max_new_tokens}")
        if self.ngram_topk < 0:
            raise GenerationError(f"n-gram top-k must be >= 0, got {self.ngram_topk}")
        if self.kv_budget < 4:
            raise GenerationError(f"the partial KV budget must be at least 4, got {self.kv_budget}")
        if self.kv_recent is not None and not 1 <= self.kv_recent < self.kv_budget:
            raise GenerationError(
                f"the partial cache's recent region must be in [1, {self.kv_budget}) (below the budget), got {self.kv_recent}"
            )
        if self.prefill_chunk < 1:
            raise GenerationError(f"prefill chunk must be positive, got {self.prefill_chunk}")


@dataclass
class Stats:
    method: str
    seed: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    iterations: int = 0  # decode iterations (AR: steps)
    forwards: int = 0  # decode forward passes: AR steps, draft passes, verify passes (timing probes excluded)
    drafted_tokens: int = 0  # per iteration, the trie's depth (the longest draft offered)
    accepted_tokens: int = 0
    ngram_accepted_tokens: int = 0  # accepted nodes that only an n-gram branch proposed
    ngram_hit_iterations: int = 0
    partial_selections: int = 0
    fixed_shape_steps: int = 0  # forwards run by StaticForward (static_steps), eager or replayed
    graph_replays: int = 0  # of those, CUDA-graph replays
    graph_captures: int = 0
    plans: list[str] = field(default_factory=list)  # tree="auto": "TREE k=K from token N", in order
    prefill_s: float = 0.0
    elapsed_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""

    @property
    def acceptance_rate(self) -> float:
        """α = accepted draft tokens / drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

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


@dataclass
class DecodeState:
    """Everything one sequence carries between iterations."""

    tokens: list[int]  # committed ids: prompt + generated; tokens[-1] is the root
    history: torch.Tensor  # [capacity] int64 mirror of `tokens` for windows
    prompt_length: int
    limit: int  # stop when len(tokens) reaches this
    full: KVCache
    partial: PartialKVCache | None
    table: NgramTable | None
    random: RandomSource
    sampling: SamplingConfig
    stop_tokens: frozenset[int]
    queries: list[torch.Tensor]  # per layer [heads, head_dim]: latest committed token's query
    sampler: Sampler  # the sampling step: compiled on float32 CPU engines (FusedSampler), else PyTorch's
    static_full: StaticForward | None = None  # fixed-shape forwards on `full` (and `partial`)
    static_partial: StaticForward | None = None

    def noise(self, positions: Sequence[int], size: int, device: torch.device) -> torch.Tensor | None:
        """[len(positions), size] Gumbel noise of those positions; None when greedy."""
        return None if self.sampling.greedy else self.random.gumbel_rows(positions, size, device)

    @property
    def root_position(self) -> int:
        return len(self.tokens) - 1

    def window(self, path: Sequence[int] = ()) -> torch.Tensor:
        """Last W tokens of committed + `path` (draft tokens after the root): what AR would see."""
        size = self.sampling.penalty_window
        if self.sampling.penalty == 1 or size == 0:
            return self.history[:0]
        end = len(self.tokens)
        start = max(0, end + len(path) - size)
        committed = self.history[start:end]
        if not path:
            return committed
        tail = to_device(list(path)[-size:], torch.long, self.history.device)
        return torch.cat((committed, tail))

    def windows(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """`window(path)` for several paths at once: [N, width] ids, rows shorter than width padded
        on the left with their own first id (a repeated id is penalised once, so padding is inert)."""
        size = self.sampling.penalty_window
        if self.sampling.penalty == 1 or size == 0:
            return self.history[:0]
        end = len(self.tokens)
        longest = max(len(path) for path in paths)
        committed = self.history[max(0, end - size) : end]  # [L]
        held = committed.numel()
        padded = [list(path) + [0] * (longest - len(path)) for path in paths]
        tails = to_device(padded, torch.long, self.history.device).view(len(paths), longest)
        rows = torch.cat((committed.expand(len(paths), held), tails), dim=1)  # [N, L + longest]
        width = min(size, held + longest)
        ends = to_device([held + len(path) for path in paths], torch.long, rows.device)  # exclusive, per row
        columns = (torch.arange(width, device=rows.device) + (ends[:, None] - width)).clamp_(min=0)
        return rows.gather(1, columns)

    def append(self, tokens: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(tokens)
        copy_from_host(self.history[start : start + len(tokens)], torch.tensor(list(tokens), dtype=torch.long))


@dataclass
class Acceptance:
    nodes: list[int]  # accepted trie nodes, root excluded, in path order
    tokens: list[int]  # emitted tokens: accepted draft tokens, then the bonus token


class NodeTargets:
    """The target's processed distribution and sample at trie nodes, computed on demand.

    The sample at node i (depth d) is the token for position root + d + 1, drawn with that
    position's random number from the distribution AR would have used there. When that number is
    fixed in advance (position-keyed noise) and the trie is small, or on a GPU, every node's sample
    is computed at the first visit in one batch (one LM-head pass, one set of sampling transforms,
    one read): each node's sample depends only on its own path, so sampling nodes the walk never
    visits changes nothing.
    """

    def __init__(self, engine: Engine, state: DecodeState, trie: Trie, hidden: torch.Tensor, draft_depth: int = 0) -> None:
        self.engine, self.state, self.trie, self.hidden = engine, state, trie, hidden  # hidden [N, hidden]
        # drafting from the verify pass: the batched LM-head pass also gives the first `draft_depth`
        # draft layers' logits at every node, so the next iteration's drafts cost no head pass of their own
        self.draft_depth = draft_depth
        self.all_draft_logits: torch.Tensor | None = None  # [draft_depth, N, V] when batched
        # On a GPU one LM-head pass over all nodes costs about what one row does (the head's weights
        # are read once); on a CPU too with the prepacked head (cpu_linear.py), up to a few rows.
        small = len(trie) <= BATCHED_NODES_MAX
        self.batched = engine.device.type == "cuda" or small
        self.all_logits: torch.Tensor | None = None  # [N, V] when batched
        self.all_samples: list[int] | None = None
        self.sample_all = self.batched and (state.random.noise_known_in_advance or state.sampling.greedy)

    def path(self, node: int) -> list[int]:
        tokens = []
        while node > 0:
            tokens.append(self.trie.tokens[node])
            node = self.trie.parents[node]
        return tokens[::-1]

    def logits(self) -> torch.Tensor:
        """[N, V] logits of every node (one LM-head pass, kept)."""
        if self.all_logits is None:
            if self.draft_depth:
                heads = self.engine.model.head_logits(self.hidden, self.engine.draft_layers, self.draft_depth)  # [1 + d, N, V]
                self.all_logits, self.all_draft_logits = heads[0], heads[1:]
            else:
                self.all_logits = self.engine.model.logits(self.hidden)
        return self.all_logits

    def draft_logits(self, node: int) -> torch.Tensor | None:
        """[draft_depth, V]: the draft layers' logits at `node` (tokens 2.. after it), when the
        batched pass computed them; None otherwise."""
        return None if self.all_draft_logits is None else self.all_draft_logits[:, node]

    def sample(self, node: int) -> int:
        if self.sample_all:
            if self.all_samples is None:
                self.all_samples = self._sample_every_node()
            return self.all_samples[node]
        position = self.state.root_position + self.trie.depths[node] + 1
        logits = self.logits()[node] if self.batched else self.engine.model.logits(self.hidden[node])  # [V]
        noise = self.state.noise([position], logits.shape[-1], logits.device)
        return self.state.sampler.samples(logits[None], self.state.window(self.path(node)), noise)[0]

    def _sample_every_node(self) -> list[int]:
        state, trie = self.state, self.trie
        paths = [self.path(node) for node in range(len(trie))]
        logits = self.logits()  # [N, V]
        # sample_all: greedy, or position-keyed noise, which nodes at one depth share
        noise = state.noise([state.root_position + depth + 1 for depth in trie.depths], logits.shape[-1], logits.device)
        return state.sampler.samples(logits, state.windows(paths), noise)


Acceptor = Callable[[Trie, NodeTargets, int, frozenset], Acceptance]


def accept_trie(trie: Trie, targets: NodeTargets, remaining: int, stop_tokens: frozenset[int]) -> Acceptance:
    """One target sample per visited trie node; walk while the sample is a child. Lossless."""
    node, nodes, tokens = 0, [], []
    while True:
        token = targets.sample(node)
        tokens.append(token)
        if len(tokens) >= remaining or token in stop_tokens:
            break
        child = trie.children[node].get(token)
        if child is None:
            break
        nodes.append(child)
        node = child
    return Acceptance(nodes, tokens)


# ---------------------------------------------------------------- stages


def forward_full(engine: Engine, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor,
                 tree_mask: torch.Tensor | None = None) -> ForwardOutput:
    """One forward of new tokens [T] on the full cache (fixed-shape when enabled); T slots left pending.

    tree_mask [T, T] bool on the host, None = causal.
    """
    if state.static_full is not None and state.static_full.fits(tokens.shape[0]):
        return state.static_full.run(tokens, positions, tree_mask)
    mask = None if tree_mask is None else tree_mask.to(engine.device)
    return engine.model(tokens, positions, state.full, tree_mask=mask, keep_queries=True)


def prefill(engine: Engine, state: DecodeState, prompt: Sequence[int], chunk: int) -> torch.Tensor:
    """Run the prompt through the full cache; returns the last position's hidden [hidden]."""
    device = engine.device
    chunk = min(chunk, getattr(engine.model, "max_tokens", chunk))  # exported plans bound T
    out: ForwardOutput | None = None
    for start in range(0, len(prompt), chunk):
        ids = torch.tensor(prompt[start : start + chunk], dtype=torch.long, device=device)
        positions = torch.arange(start, start + ids.numel(), device=device)
        out = engine.model(ids, positions, state.full, keep_queries=True)
        state.full.commit()
    assert out is not None and out.queries is not None
    state.queries = [q[-1] for q in out.queries]
    return out.hidden[-1]


def sample_next(engine: Engine, state: DecodeState, hidden: torch.Tensor) -> int:
    """AR step's choice for position len(tokens), from hidden [hidden] of the last committed token."""
    logits = engine.model.logits(hidden)[None]  # [1, V]
    return state.sampler.samples(logits, state.window(), state.noise([len(state.tokens)], logits.shape[-1], logits.device))[0]


def ar_step(engine: Engine, state: DecodeState) -> ForwardOutput:
    """One AR step: the root's forward on the full cache, committed; the next token is sampled and
    appended (it is the new root). Returns the forward (hidden and queries of the old root)."""
    device = engine.device
    root = to_device([state.tokens[-1]], torch.long, device)
    position = to_device([state.root_position], torch.long, device)
    out = forward_full(engine, state, root, position)
    state.full.commit()
    state.append([sample_next(engine, state, out.hidden[0])])
    return out


def propose(engine: Engine, state: DecodeState, tree: StaticTree) -> list[list[int]]:
    """Draft forward of the root on the partial cache -> candidates per head [depth][branching]."""
    device = engine.device
    root = to_device([state.tokens[-1]], torch.long, device)
    position = to_device([state.root_position], torch.long, device)
    assert state.partial is not None
    if state.static_partial is not None:
        hidden = state.static_partial.run(root, position).hidden  # [1, hidden]
        logits = engine.model.head_logits(hidden, engine.draft_layers)[:, 0]  # [1 + n, V]
    else:
        logits = engine.model.draft(root, position, state.partial, engine.draft_layers)  # [1 + n, V]
    return _top_candidates(logits, state, tree)


def _top_candidates(logits: torch.Tensor, state: DecodeState, tree: StaticTree) -> list[list[int]]:
    """logits [≥ depth, V] (row d drafts position root + 1 + d) -> per depth the top
    `branching[depth]` ids after the sampling transforms, ranked with the noise the target will
    sample those positions with (`draft_ranking`; all depths one batch, one device-to-host copy).
    Drafts never change what is sampled, only how much is accepted."""
    depths = len(tree.branching)
    noises = None
    if state.random.noise_known_in_advance:
        noises = state.noise([state.root_position + 1 + d for d in range(depths)], logits.shape[-1], logits.device)
    ranked = state.sampler.rank(logits[:depths], state.window(), noises, max(tree.branching))  # [depths, width]
    flat = iter(ranked.tolist())
    return [next(flat)[:width] for width in tree.branching]


def candidates_from_hidden(engine: Engine, state: DecodeState, hidden: torch.Tensor, tree: StaticTree,
                           draft_logits: torch.Tensor | None = None) -> list[list[int]]:
    """Draft from the last committed token's hidden state [hidden]: draft layer d proposes depth d.
    `draft_logits` [≥ depth, V], when the verify pass's LM-head pass already computed them, saves the head pass."""
    if draft_logits is None or draft_logits.shape[0] < tree.depth:
        draft_logits = engine.model.draft_logits(hidden[None], engine.draft_layers, tree.depth)[:, 0]  # [depth, V]
    return _top_candidates(draft_logits, state, tree)


def retrieve_ngrams(state: DecodeState, first_tokens: Sequence[int], k: int) -> list[tuple[int, ...]]:
    """Top-k committed 4-grams starting with each distinct token of `first_tokens` (head 0's
    candidates: the depth-1 drafts, or the root when drafting from the verify pass)."""
    if state.table is None or k <= 0:
        return []
    paths: list[tuple[int, ...]] = []
    for token in dict.fromkeys(first_tokens):
        paths.extend(state.table.top(token, k))
    return paths


def verify(engine: Engine, state: DecodeState, trie: Trie) -> ForwardOutput:
    """One forward of every trie node on the full cache with the trie's ancestor mask."""
    device = engine.device
    tokens = to_device(trie.tokens, torch.long, device)
    positions = to_device([depth + state.root_position for depth in trie.depths], torch.long, device)
    return forward_full(engine, state, tokens, positions, trie.mask())


def commit(state: DecodeState, acceptance: Acceptance, verified: ForwardOutput, ngram_exclusion: int) -> None:
    """Keep the root's and accepted nodes' K/V, extend history, partial cache and n-gram table."""
    start = state.full.length
    kept = [0] + acceptance.nodes
    state.full.keep(kept)
    assert verified.queries is not None
    state.queries = [q[kept[-1]] for q in verified.queries]
    state.append(acceptance.tokens)
    if state.partial is not None:
        state.partial.append_from(state.full, start, len(kept), state.queries)
    if state.table is not None:
        state.table.update(state.tokens, len(state.tokens) - ngram_exclusion)


# ---------------------------------------------------------------- loop


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
            f"the prompt has {len(prompt)} tokens but the engine's maximum length is {max_length}: shorten the prompt"
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
) -> tuple[list[int], Stats]:
    """Generate after `prompt`; returns the new token ids and `Stats`.

    Stops at max_new_tokens, at an EOS token unless ignore_eos, or at the engine's maximum length
    (stop_reason says which). `on_tokens` receives each batch of newly committed tokens;
    `observer` sees the live Stats after every iteration (new_tokens and elapsed_s current).
    `config.tree == "auto"` tunes the tree and n-gram k while generating (runtime/autotune.py).
    """
    steps = decode_steps(engine, prompt, config, on_tokens, random, acceptor)
    while True:
        try:
            stats = next(steps)
        except StopIteration as finished:
            return finished.value
        if observer:
            observer(stats)


@torch.inference_mode()
def decode_steps(
    engine: Engine,
    prompt: Sequence[int],
    config: GenerationConfig,
    on_tokens: Callable[[list[int]], None] | None = None,
    random: RandomSource | None = None,
    acceptor: Acceptor = accept_trie,
) -> DecodeSteps:
    """`generate` one iteration at a time: yields the live Stats after every iteration and returns
    (new token ids, Stats) when done. Nothing runs between yields, so callers can interleave several
    generations and time each on its own clock (the bench does, so that drift hits all alike)."""
    max_length = _check_request(engine, prompt, config)
    from_verify = config.draft_source == "verify"
    tree = build_static_tree((VERIFY_PROBE_TREE if from_verify else PROBE_TREE) if config.tree == AUTO else config.tree)
    max_depth = len(engine.draft_layers) + (0 if from_verify else 1)
    if config.method == "tokenswift" and tree.depth > max_depth:
        raise GenerationError(
            f"tree {config.tree!r} is {tree.depth} deep but the engine has {len(engine.draft_layers)} draft layers "
            f"(at most {max_depth} levels when drafting from the {config.draft_source} pass)"
        )
    ngram_topk = PROBE_TOPK if config.tree == AUTO else config.ngram_topk
    seed = config.seed if config.seed is not None else random_module.SystemRandom().randrange(2**63)
    stats = Stats(method=config.method, seed=seed, prompt_tokens=len(prompt))
    limit = min(len(prompt) + config.max_new_tokens, max_length)
    max_trie = tree.num_nodes + ngram_topk * tree.branching[0] * NGRAM_LENGTH
    cfg, dtype, device = engine.config, engine.dtype, engine.device
    static = config.static_steps if config.static_steps is not None else device.type == "cuda"
    static = static and isinstance(engine.model, LlamaModel)  # exported graphs (onnx, TensorRT) have their own
    max_trie = bucket_for(max_trie) if static else max_trie  # slots a padded forward writes
    plan = plan_memory(engine, limit + max_trie, config.kv_budget if config.method == "tokenswift" else 0, max_trie)
    try:
        admit(plan, config.memory_budget if config.memory_budget is not None else available_bytes(device))
    except AdmissionError as error:
        raise GenerationError(str(error)) from None
    full = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, limit + max_trie, dtype, device)
    state = DecodeState(
        tokens=list(prompt),
        history=torch.zeros(limit + max_trie, dtype=torch.long, device=device),
        prompt_length=len(prompt),
        limit=limit,
        full=full,
        partial=None,
        table=None,
        random=random or PositionKeyedRandom(seed),
        sampling=config.sampling,
        stop_tokens=frozenset() if config.ignore_eos else frozenset(cfg.eos_token_ids),
        queries=[],
        sampler=fused_sampler(config.sampling, device, dtype) or TorchSampler(config.sampling),
    )
    state.history[: len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
    if static:
        state.static_full = StaticForward(engine.model, full, capture=device.type == "cuda")

    started = time.perf_counter()
    hidden = prefill(engine, state, prompt, config.prefill_chunk)
    first = sample_next(engine, state, hidden)
    state.append([first])
    stats.prefill_s = time.perf_counter() - started
    if on_tokens:
        on_tokens([first])
    done = first in state.stop_tokens or len(state.tokens) >= limit

    if config.method == "ar":
        while not done:
            tick = time.perf_counter()
            ar_step(engine, state)
            token = state.tokens[-1]
            stats.iterations += 1
            stats.forwards += 1
            stats.add_time("forward", time.perf_counter() - tick)
            stats.new_tokens, stats.elapsed_s = len(state.tokens) - len(prompt), time.perf_counter() - started
            if on_tokens:
                on_tokens([token])
            yield stats
            done = token in state.stop_tokens or len(state.tokens) >= limit
    else:
        yield from _tokenswift_loop(engine, state, config, stats, started, hidden, on_tokens, acceptor)

    stats.elapsed_s = time.perf_counter() - started
    for runner in (state.static_full, state.static_partial):
        if runner is not None:
            stats.fixed_shape_steps += runner.counters.eager_runs + runner.counters.graph_replays
            stats.graph_replays += runner.counters.graph_replays
            stats.graph_captures += runner.counters.captures
    new_tokens = state.tokens[len(prompt) :]
    stats.new_tokens = len(new_tokens)
    if new_tokens[-1] in state.stop_tokens:
        stats.stop_reason = "eos"
    elif len(new_tokens) >= config.max_new_tokens:
        stats.stop_reason = "max_new_tokens"
    else:
        stats.stop_reason = "max_length"
    return new_tokens, stats


def _measure_verify(engine: Engine, state: DecodeState, max_size: int) -> dict[int, float]:
    """Seconds of one verify forward at the current context for several trie sizes."""
    device = engine.device
    root_position = state.root_position

    def forward(size: int) -> None:
        tokens = torch.full((size,), state.tokens[-1], dtype=torch.long, device=device)
        positions = torch.arange(root_position, root_position + size, device=device)
        forward_full(engine, state, tokens, positions)
        state.full.pending = 0  # timing only: nothing written is kept

    # small sizes too: with a tree-attention kernel a few tokens cost what one does (not a straight line to 16)
    sizes = sorted({s for s in (1, 2, 4, 8, 16, 48) if s <= max_size} | {max_size})
    return time_verify(forward, sizes, repeats=5)


def _measure_ranking(engine: Engine, state: DecodeState, hidden: torch.Tensor) -> float:
    """Seconds to draft from logits the verify pass's head pass already holds (transforms and
    noise ranking of one draft level): the whole drafting cost of a batched trie in verify mode."""
    logits = engine.model.draft_logits(hidden[None], engine.draft_layers, 1)[:, 0]  # [1, V]
    tree = build_static_tree("3")
    return time_verify(lambda _: _top_candidates(logits, state, tree), [1], repeats=3)[1]


def _measure_sampling(engine: Engine, state: DecodeState, hidden: torch.Tensor, draft_depth: int) -> dict[int, float]:
    """Seconds to turn verified rows into the target's samples: N = 1 is an AR step's (`sample_next`);
    N = 2..BATCHED_NODES_MAX a trie of N nodes sampled as one batch (LM-head pass with `draft_depth`
    draft rows per node, transforms, noise, one read). hidden [hidden] stands in for every node."""
    def sample(size: int) -> None:
        if size == 1:
            sample_next(engine, state, hidden)
            return
        trie = build_trie(state.tokens[-1], build_static_tree(str(size - 1)), [list(range(size - 1))])
        NodeTargets(engine, state, trie, hidden.expand(size, -1).contiguous(), draft_depth).sample(0)

    return time_verify(sample, [1, 2, 4, 8, BATCHED_NODES_MAX], repeats=5)


def _tokenswift_loop(
    engine: Engine,
    state: DecodeState,
    config: GenerationConfig,
    stats: Stats,
    started: float,
    last_hidden: torch.Tensor,  # [hidden] of the last committed token (drafting from the verify pass)
    on_tokens: Callable[[list[int]], None] | None,
    acceptor: Acceptor,
) -> Generator[Stats, None, None]:
    cfg, device = engine.config, engine.device
    ngram_exclusion = config.sampling.penalty_window if config.sampling.penalty > 1 else 0
    from_verify = config.draft_source == "verify"
    if not from_verify:
        state.partial = PartialKVCache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.kv_budget, recent=config.kv_recent,
            dtype=engine.dtype, device=device,
        )
        state.partial.select(state.full, state.queries)
        if state.static_full is not None:
            state.static_partial = StaticForward(engine.model, state.partial, capture=state.static_full.capture)
    auto = config.tree == AUTO
    probe_tree = VERIFY_PROBE_TREE if from_verify else PROBE_TREE
    max_depth = len(engine.draft_layers) + (0 if from_verify else 1)
    plan_tree, ngram_topk = (probe_tree, PROBE_TOPK) if auto else (config.tree, config.ngram_topk)
    if ngram_topk > 0:
        state.table = NgramTable(NGRAM_LENGTH)
        state.table.update(state.tokens, len(state.tokens) - ngram_exclusion)
    tree: StaticTree | None = build_static_tree(plan_tree)
    recorder = ProbeRecorder(max_depth=max_depth, probe_tree=probe_tree) if auto else None  # kept over all probes
    probing = auto
    probe_costs = {"iterations": 0.0, "draft": 0.0, "trie": 0.0, "nodes": 0.0, "commit": 0.0}  # this probe's host work
    next_probe = len(state.tokens) + RETUNE_EVERY
    max_trie = state.full.capacity - state.limit
    if auto:
        stats.plans.append(f"probe {probe_tree} k={PROBE_TOPK} from token {stats.new_tokens if stats.new_tokens else 1}")
    last_draft_logits: torch.Tensor | None = None  # [depth, V] at the last committed token, from the verify pass
    done = False
    drafting_state_stale = False  # AR steps skip the partial cache and n-gram table upkeep
    while not done:
        tick = time.perf_counter()
        if tree is None:  # a plain AR step, the same code as the AR baseline's
            out = ar_step(engine, state)
            assert out.queries is not None
            state.queries, last_hidden, last_draft_logits = [q[-1] for q in out.queries], out.hidden[0], None
            acceptance = Acceptance(nodes=[], tokens=state.tokens[-1:])
            drafting_state_stale = True
            stats.add_time("ar_step", time.perf_counter() - tick)
            stats.forwards += 1
        else:
            if drafting_state_stale:  # catch up after AR steps: reselect the partial cache, count the n-grams
                if state.partial is not None:
                    state.partial.select(state.full, state.queries)
                if state.table is not None:
                    state.table.update(state.tokens, len(state.tokens) - ngram_exclusion)
                drafting_state_stale = False
                tick = time.perf_counter()
            if from_verify:
                candidates = candidates_from_hidden(engine, state, last_hidden, tree, last_draft_logits)
            else:
                candidates = propose(engine, state, tree)
            t_draft = time.perf_counter()
            # head 0's candidates key the n-grams; drafting from the verify pass, head 0's token is the root
            keys = [state.tokens[-1]] if from_verify else candidates[0]
            trie = build_trie(state.tokens[-1], tree, candidates, retrieve_ngrams(state, keys, ngram_topk), from_verify)
            t_trie = time.perf_counter()
            verified = verify(engine, state, trie)
            t_verify = time.perf_counter()
            targets = NodeTargets(engine, state, trie, verified.hidden, tree.depth if from_verify else 0)
            acceptance = acceptor(trie, targets, state.limit - len(state.tokens), state.stop_tokens)
            t_accept = time.perf_counter()
            commit(state, acceptance, verified, ngram_exclusion)
            last_node = acceptance.nodes[-1] if acceptance.nodes else 0
            last_hidden, last_draft_logits = verified.hidden[last_node], targets.draft_logits(last_node)
            t_commit = time.perf_counter()
            for phase, begin, end in (
                ("draft", tick, t_draft), ("trie", t_draft, t_trie), ("verify", t_trie, t_verify),
                ("accept", t_verify, t_accept), ("commit", t_accept, t_commit),
            ):
                stats.add_time(phase, end - begin)
            stats.forwards += 1 if from_verify else 2  # verify (+ the draft pass)
            stats.drafted_tokens += max(trie.depths)  # the longest draft offered (n-gram branches may pass the tree)
            stats.accepted_tokens += len(acceptance.nodes)
            ngram_accepted = sum(1 for node in acceptance.nodes if not trie.from_tree[node])
            stats.ngram_accepted_tokens += ngram_accepted
            stats.ngram_hit_iterations += ngram_accepted > 0
        stats.iterations += 1
        stats.new_tokens, stats.elapsed_s = len(state.tokens) - state.prompt_length, time.perf_counter() - started
        if on_tokens:
            on_tokens(acceptance.tokens)
        yield stats
        done = acceptance.tokens[-1] in state.stop_tokens or len(state.tokens) >= state.limit
        if probing and recorder is not None:  # probing: the last iteration drafted (tree is not None)
            recorder.record(trie, acceptance.nodes)
            for key, value in (("iterations", 1), ("draft", t_draft - tick), ("trie", t_trie - t_draft),
                               ("nodes", len(trie)), ("commit", t_commit - t_accept)):
                probe_costs[key] += value
            if probe_costs["iterations"] >= PROBE_ITERATIONS and not done:
                costs = _measure_verify(engine, state, max_trie)
                # drafting from the verify pass the head pass carries draft rows (one level: the trees CPUs pick)
                sampling = _measure_sampling(engine, state, last_hidden, 1 if from_verify else 0)
                count = probe_costs["iterations"]
                plan, _ = choose_plan(
                    recorder, costs, probe_costs["draft"] / count, probe_costs["commit"] / count,
                    sampling, None if device.type == "cuda" else BATCHED_NODES_MAX,
                    per_node_s=probe_costs["trie"] / probe_costs["nodes"],  # building a trie (n-grams included)
                    batched_draft_s=_measure_ranking(engine, state, last_hidden) if from_verify else None,
                )
                tree = None if plan.tree == AR_PLAN else build_static_tree(plan.tree)
                ngram_topk = plan.ngram_topk
                stats.plans.append(f"{plan.tree} k={plan.ngram_topk} from token {stats.new_tokens}")
                probing, probe_costs = False, dict.fromkeys(probe_costs, 0.0)
                next_probe = len(state.tokens) + (RETUNE_AFTER_AR if tree is None else RETUNE_EVERY)
        elif recorder is not None and tree is not None and not done:  # the chosen plan's iterations count too
            recorder.record(trie, acceptance.nodes, (tree.branching, ngram_topk))
        if auto and not probing and len(state.tokens) >= next_probe:
            probing = True
            tree, ngram_topk = build_static_tree(probe_tree), PROBE_TOPK
            stats.plans.append(f"probe {probe_tree} k={PROBE_TOPK} from token {stats.new_tokens}")
    stats.partial_selections = state.partial.selections if state.partial is not None else 0
