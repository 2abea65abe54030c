"""The named stages of one decoding iteration, and the state a sequence carries between them.

Terms (one iteration):
- root token: the last sampled token; committed as output but not yet in the KV cache.
- draft tokens: the trie's nodes below the root (static tree from the draft heads + n-grams).
- accepted tokens: draft tokens the target itself produced at their position, walking from the
  root; `accept_length` = how many.
- bonus token: the target's sample after the last accepted node; it becomes the next root.
Every iteration therefore commits accept_length + 1 tokens.

Stages: propose (draft forward on the partial cache, or the last verify pass's draft rows ->
per-depth candidates; n-gram branches) -> build trie (tree.py) -> verify (one forward over the
trie on the full cache) -> accept (one target sample per visited node) -> commit (full cache,
partial cache, n-gram table, token history).

Each stage has a host form and, where the device loop runs it, a batched device form beside it
(tensors in, tensors out, nothing read back): the trie (`tree.Trie` / `tree.TrieSlots`), the n-gram
table (`ngram.NgramTable` / `ngram.NgramTensors`), penalty windows (`DecodeState.windows` /
`DecodeState.slot_windows`), the acceptance walk (`accept_trie` / `accept_slots`) and the commit
(`commit` / `commit_chain`). Two executors string them into iterations: the host loop (loop.py) and
the device loop (device_loop.py, one CUDA graph per iteration); tests/decode/test_executors.py
shows they commit the same tokens, iteration by iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from tokenswift_trt.decode.ngram import NgramTable
from tokenswift_trt.decode.static_step import StaticForward
from tokenswift_trt.decode.suffix import SuffixIndex
from tokenswift_trt.decode.tree import Candidates, StaticTree, Trie, TrieTensors
from tokenswift_trt.kernels.transfer import copy_from_host, to_device
from tokenswift_trt.model.decoder import ForwardOutput, drafts_along_paths, reads_root
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.kv_cache import KVCache, PartialKVCache
from tokenswift_trt.model.sampling import Noise, RandomSource, Sampler, SamplingConfig

BATCHED_NODES_MAX = 16  # on a CPU, tries up to this size sample every node in one batch
CHAIN_ROWS = 8  # on a CPU, a larger trie's visit samples this many nodes down its deepest path at once
SUFFIX_MIN_MATCH = 8  # a long match's branch is offered from this many matching tokens


def sampled_in_one_batch(num_nodes: float, device: torch.device) -> bool:
    """Whether a trie's nodes get the target's logits and samples in one batch (one LM-head pass,
    one set of sampling transforms, one read) rather than one node per visit of the acceptance
    walk. On a GPU one LM-head pass over all nodes costs about what one row does (the head's
    weights are read once); on a CPU too with the prepacked head (linear.py), up to a few rows.
    `NodeTargets` and the tuner's cost model (autotune.py) both ask this function."""
    return device.type == "cuda" or num_nodes <= BATCHED_NODES_MAX


def chain_rows(state: DecodeState) -> int:
    """Nodes a visit of a trie too large for one batch samples at once (`NodeTargets`): CHAIN_ROWS
    where each node's sample depends only on its own path (greedy, or position-keyed noise), else 1."""
    return CHAIN_ROWS if state.random.noise_known_in_advance or state.sampling.greedy else 1


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
    sampler: Sampler  # the sampling step: compiled on float32 CPU engines (FusedSampler), else PyTorch's
    # n-gram table: 4-grams ending before the last `ngram_exclusion` tokens (the penalty window)
    ngram_exclusion: int = 0
    suffix: SuffixIndex | None = None  # long matches (suffix.py); None: off
    static_full: StaticForward | None = None  # fixed-shape forwards on `full` (and `partial`)
    static_partial: StaticForward | None = None
    queries: list[torch.Tensor] = field(
        default_factory=list
    )  # per layer [heads, head_dim]: latest committed query
    needed_bytes: int = 0  # what its admission counted: caches and tree buffers (decode/admission.py)

    def noise(self, positions: Sequence[int], size: int, device: torch.device) -> Noise:
        """[len(positions), size] Gumbel noise of those positions (or their keys, for a sampler that
        computes the noise it needs itself); None when greedy."""
        if self.sampling.greedy:
            return None
        if self.sampler.takes_keys:
            keys = self.random.keys(positions)
            if keys is not None:
                return keys
        return self.random.gumbel_rows(positions, size, device)

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

    def slot_windows(
        self, count: torch.Tensor, paths: torch.Tensor | None = None, depths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`window` / `windows` on the device, `count` (0-d) tokens committed: the committed window [W]
        (paths None), or per slot [S, W]: the last W of committed + the slot's path (paths [S, Dmax],
        -1 past depths [S]; shorter contexts padded with the first token, which is then in the window
        anyway, so the padding is inert)."""
        size = self.sampling.penalty_window
        if self.sampling.penalty == 1 or size == 0:
            return self.history[:0]
        offsets = torch.arange(-size, 0, device=self.history.device)  # the window before `count`
        committed = self.history[(count + offsets).clamp(min=0)]  # [W]
        if paths is None or depths is None:
            return committed
        rows = torch.cat((committed.expand(paths.shape[0], -1), paths.clamp(min=0)), dim=1)  # [S, W + Dmax]
        return rows.gather(1, depths[:, None] + (offsets + size)[None, :])

    def append(self, tokens: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(tokens)
        copy_from_host(
            self.history[start : start + len(tokens)], torch.tensor(list(tokens), dtype=torch.long)
        )


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

    def __init__(
        self, engine: Engine, state: DecodeState, trie: Trie, hidden: torch.Tensor, draft_depth: int = 0
    ) -> None:
        self.engine, self.state, self.trie, self.hidden = engine, state, trie, hidden  # hidden [N, hidden]
        # drafting from the verify pass: the batched LM-head pass also gives the first `draft_depth`
        # draft layers' logits at every node, so the next iteration's drafts cost no head pass of their own
        # (not for root-conditioned layers: they read each node's sample, known only after this pass)
        self.draft_depth = 0 if reads_root(engine.draft_layers) else draft_depth
        self.all_draft_logits: torch.Tensor | None = None  # [draft_depth, N, V] when batched
        self.batched = sampled_in_one_batch(len(trie), engine.device)
        self.all_logits: torch.Tensor | None = None  # [N, V] when batched
        self.all_samples: list[int] | None = None
        self.sample_all = self.batched and chain_rows(state) > 1
        # a larger trie on a CPU: a visit samples its node and the deepest path below it, up to
        # `CHAIN_ROWS` nodes in one LM-head pass (a few rows cost what one does), so a long match's
        # branch costs a pass per `CHAIN_ROWS` accepted tokens instead of one per token
        self.chain_rows = 1 if self.batched else chain_rows(state)
        self.known: dict[int, int] = {}  # node -> sample, from chained visits
        self._heights: list[int] | None = None

    def path(self, node: int) -> list[int]:
        tokens = []
        while node > 0:
            tokens.append(self.trie.tokens[node])
            node = self.trie.parents[node]
        return tokens[::-1]

    def logits(self, windows: torch.Tensor | None = None) -> torch.Tensor:
        """[N, V] logits of every node for sampling (one LM-head pass, kept); `windows`: every node's
        penalty window (`DecodeState.windows` of their paths) when the caller has them, which lets a CPU
        engine read its screened head (without them the full head runs)."""
        if self.all_logits is None:
            if self.draft_depth:
                heads = self.engine.model.head_logits(
                    self.hidden, self.engine.draft_layers, self.draft_depth
                )  # [1 + d, N, V]
                self.all_logits, self.all_draft_logits = heads[0], heads[1:]
            else:
                self.all_logits = self.engine.model.target_logits(self.hidden, self.state.sampling, windows)
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
        if self.chain_rows > 1:
            if node not in self.known:
                chain = self._deepest_chain(node)
                self.known.update(zip(chain, self._sample_nodes(chain), strict=True))
            return self.known[node]
        position = self.state.root_position + self.trie.depths[node] + 1
        window = self.state.window(self.path(node))
        if self.batched:
            logits = self.logits()[node]  # [V]
        else:
            logits = self.engine.model.target_logits(self.hidden[node][None], self.state.sampling, window)[0]
        noise = self.state.noise([position], logits.shape[-1], logits.device)
        return self.state.sampler.samples(logits[None], window, noise)[0]

    def _sample_every_node(self) -> list[int]:
        windows = self.state.windows([self.path(node) for node in range(len(self.trie))])
        return self._samples(range(len(self.trie)), self.logits(windows), windows)

    def _sample_nodes(self, nodes: list[int]) -> list[int]:
        """Samples at `nodes` from one LM-head pass over their rows."""
        windows = self.state.windows([self.path(node) for node in nodes])
        logits = self.engine.model.target_logits(self.hidden[nodes], self.state.sampling, windows)  # [n, V]
        return self._samples(nodes, logits, windows)

    def _samples(self, nodes: Sequence[int], logits: torch.Tensor, windows: torch.Tensor) -> list[int]:
        """Samples from `nodes`' logits [n, V]: greedy, or position-keyed noise, which nodes at one
        depth share."""
        state, depths = self.state, self.trie.depths
        positions = [state.root_position + depths[node] + 1 for node in nodes]
        return state.sampler.samples(logits, windows, state.noise(positions, logits.shape[-1], logits.device))

    def _deepest_chain(self, node: int) -> list[int]:
        """`node`, then down its deepest child's line: at most `chain_rows` nodes."""
        if self._heights is None:  # a node's index is above its parent's: one pass from the leaves
            trie, heights = self.trie, [0] * len(self.trie)
            for child in range(len(trie) - 1, 0, -1):
                parent = trie.parents[child]
                heights[parent] = max(heights[parent], heights[child] + 1)
            self._heights = heights
        chain = [node]
        while len(chain) < self.chain_rows and self.trie.children[node]:
            node = max(self.trie.children[node].values(), key=self._heights.__getitem__)
            chain.append(node)
        return chain


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


@dataclass
class Walk:
    """`Acceptance` on the device (`accept_slots`)."""

    chain: torch.Tensor  # [Dmax + 1] slots of the accepted chain by depth (root first; 0 past its end)
    emitted: torch.Tensor  # [Dmax + 1] the target's samples along the chain (accepted tokens, then bonus)
    count: torch.Tensor  # 0-d: tokens committed (emitted[:count])
    last: torch.Tensor  # 0-d: the slot whose sample is the bonus token
    stopped: torch.Tensor  # 0-d bool: an EOS token or the limit ends the generation


def accept_slots(
    trie: TrieTensors,
    samples: torch.Tensor,  # [S] the target's sample at every slot
    remaining: torch.Tensor,  # 0-d tokens left before the limit (>= 1)
    stop_ids: torch.Tensor,  # [E] stop token ids (may be empty)
    max_depth: int,
) -> Walk:
    """`accept_trie` as tensor algebra, every slot sampled: a live slot is accepted when its token is
    the target's sample at its parent and its parent is accepted. De-duplicated, a parent has at most
    one live child per token, so the accepted slots form one chain from the root; it is cut, as
    `accept_trie` is, at the first stop token and at the limit."""
    matched = trie.live & (trie.tokens == samples[trie.parents])
    matched[0].fill_(True)  # not `= True`: that copies a host scalar, refused during graph capture
    accepted = trie.live & ~(trie.mask & ~matched[None, :]).any(dim=-1)  # [S]: every ancestor matched
    last = torch.where(accepted, trie.depths, -1).argmax().reshape(1)  # 1-d indices: no read-back
    levels = torch.arange(max_depth + 1, device=samples.device)
    on_chain = trie.mask[last] & (trie.depths[None, :] == levels[:, None])  # [Dmax + 1, S]
    chain = on_chain.long().argmax(dim=1)
    emitted = samples[chain]
    length = trie.depths[last][0]
    is_stop = torch.isin(emitted, stop_ids) & (levels <= length)
    first_stop = torch.where(is_stop, levels, max_depth + 1).min()
    cut = torch.minimum(torch.minimum(length, remaining - 1), first_stop)
    bonus = chain[cut.clamp(min=0).reshape(1)][0]
    return Walk(chain, emitted, cut + 1, bonus, (first_stop <= cut) | (remaining <= cut + 1))


# ---------------------------------------------------------------- stages


@dataclass
class ForwardCall:
    """A forward a request's loop asks for on its full cache: new tokens [T] at their positions with a
    tree mask [T, T] (host, None = causal); `out` is set by whoever runs it: the request's own driver
    alone (`run_alone`), or a scheduler batching it with other requests' calls (decode/scheduler.py).
    The loops yield these so that the same code runs one request or many."""

    state: DecodeState
    tokens: torch.Tensor  # [T] int64 on the engine's device
    positions: torch.Tensor  # [T] int64
    tree_mask: torch.Tensor | None = None  # [T, T] bool on the host
    out: ForwardOutput | None = None
    # an AR step's: the target's logits [1, V] at its row for sampling (`sample_next`), which a
    # scheduler may compute for several requests in one LM-head pass; None: the step computes them
    wants_logits: bool = False
    logits: torch.Tensor | None = None
    plain: bool = False  # a prompt chunk's: the model's own forward, never the fixed-shape step

    def run_alone(self, engine: Engine) -> None:
        if self.plain:
            self.out = engine.model(self.tokens, self.positions, self.state.full, keep_queries=True)
            return
        self.out = forward_full(engine, self.state, self.tokens, self.positions, self.tree_mask)


ForwardCalls = Generator[ForwardCall, None, ForwardOutput]  # yields one call, returns its output


def call_forward(
    state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None = None
) -> ForwardCalls:
    """`yield from` it for a forward on the full cache: T slots left pending, as `forward_full`."""
    call = ForwardCall(state, tokens, positions, tree_mask)
    yield call
    assert call.out is not None, "the driver runs every call before resuming its request"
    return call.out


def forward_full(
    engine: Engine,
    state: DecodeState,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
) -> ForwardOutput:
    """One forward of new tokens [T] on the full cache (fixed-shape when enabled); T slots left pending.

    tree_mask [T, T] bool on the host, None = causal.
    """
    if state.static_full is not None and state.static_full.fits(tokens.shape[0]):
        return state.static_full.run(tokens, positions, tree_mask)
    mask = None if tree_mask is None else tree_mask.to(engine.device)
    return engine.model(tokens, positions, state.full, tree_mask=mask, keep_queries=True)


def prefill(
    engine: Engine, state: DecodeState, prompt: Sequence[int], chunk: int
) -> Generator[ForwardCall, None, torch.Tensor]:
    """Run the prompt through the full cache, `chunk` tokens per forward; returns the last position's
    hidden [hidden]. Each chunk is a `ForwardCall` (`yield from` it): a scheduler runs a joining
    request's chunks in the batch's steps, one a step, so the requests generating meanwhile go on."""
    device = engine.device
    chunk = min(chunk, engine.model.max_tokens or chunk)  # exported plans bound T
    out: ForwardOutput | None = None
    for start in range(0, len(prompt), chunk):
        ids = torch.tensor(prompt[start : start + chunk], dtype=torch.long, device=device)
        positions = torch.arange(start, start + ids.numel(), device=device)
        call = ForwardCall(state, ids, positions, plain=True)
        yield call
        out = call.out
        state.full.commit()
    assert out is not None and out.queries is not None
    state.queries = [q[-1] for q in out.queries]
    return out.hidden[-1]


def prefill_alone(engine: Engine, state: DecodeState, prompt: Sequence[int], chunk: int) -> torch.Tensor:
    """`prefill` with each chunk's forward run at once (a request alone, no scheduler)."""
    steps = prefill(engine, state, prompt, chunk)
    try:
        call = next(steps)
        while True:
            call.run_alone(engine)
            call = steps.send(None)
    except StopIteration as done:
        return done.value


def sample_next(
    engine: Engine, state: DecodeState, hidden: torch.Tensor, logits: torch.Tensor | None = None
) -> int:
    """AR step's choice for position len(tokens), from hidden [hidden] of the last committed token;
    `logits` [1, V]: its target logits where the caller has them (`ForwardCall.logits`)."""
    window = state.window()
    if logits is None:
        logits = engine.model.target_logits(hidden[None], state.sampling, window)  # [1, V]
    return state.sampler.samples(
        logits, window, state.noise([len(state.tokens)], logits.shape[-1], logits.device)
    )[0]


def ar_step(engine: Engine, state: DecodeState) -> ForwardCalls:
    """One AR step: the root's forward on the full cache, committed; the next token is sampled and
    appended (it is the new root). Returns the forward (hidden and queries of the old root)."""
    device = engine.device
    root = to_device([state.tokens[-1]], torch.long, device)
    position = to_device([state.root_position], torch.long, device)
    call = ForwardCall(state, root, position, wants_logits=True)
    yield call
    out = call.out
    assert out is not None, "the driver runs every call before resuming its request"
    state.full.commit()
    state.append([sample_next(engine, state, out.hidden[0], call.logits)])
    return out


def propose(engine: Engine, state: DecodeState, tree: StaticTree) -> list[list[int]]:
    """Draft forward of the root on the partial cache -> candidates per head [depth][branching]."""
    device = engine.device
    root = to_device([state.tokens[-1]], torch.long, device)
    position = to_device([state.root_position], torch.long, device)
    assert state.partial is not None
    choose_root = None
    if reads_root(engine.draft_layers):  # the layers follow the base row's first draft, as ranked below
        choose_root = lambda base: first_draft(base, state)  # noqa: E731
    if state.static_partial is not None:
        hidden = state.static_partial.run(root, position).hidden  # [1, hidden]
        logits = engine.model.head_logits(hidden, engine.draft_layers, None, choose_root)[:, 0]  # [1 + n, V]
    elif choose_root is not None and hasattr(engine.model, "decode"):
        hidden = engine.model.decode(root, position, state.partial).hidden[-1:]
        logits = engine.model.head_logits(hidden, engine.draft_layers, None, choose_root)[:, 0]
    else:
        logits = engine.model.draft(root, position, state.partial, engine.draft_layers)  # [1 + n, V]
    return top_candidates(logits, state, tree)


def first_draft(base: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """base [1, V]: the base head's logits for the position after the root -> [1] the token
    `top_candidates` ranks first there (the transforms, then the noise the target will sample that
    position with): with the noise known in advance, the target's own sample."""
    noise = None
    if state.random.noise_known_in_advance:
        noise = state.noise([state.root_position + 1], base.shape[-1], base.device)
    return state.sampler.rank(base, state.window(), noise, 1)[:, 0].to(base.device)


def top_candidates(logits: torch.Tensor, state: DecodeState, tree: StaticTree) -> list[list[int]]:
    """logits [≥ depth, V] (row d drafts position root + 1 + d) -> per depth the top
    `branching[depth]` ids after the sampling transforms, ranked with the noise the target will
    sample those positions with (`draft_ranking`; all depths one batch, one device-to-host copy).
    Drafts never change what is sampled, only how much is accepted."""
    depths = len(tree.branching)
    noises = None
    if state.random.noise_known_in_advance:
        noises = state.noise(
            [state.root_position + 1 + d for d in range(depths)], logits.shape[-1], logits.device
        )
    ranked = state.sampler.rank(
        logits[:depths], state.window(), noises, max(tree.branching)
    )  # [depths, width]
    flat = iter(ranked.tolist())
    return [next(flat)[:width] for width in tree.branching]


def candidates_from_hidden(
    engine: Engine,
    state: DecodeState,
    hidden: torch.Tensor,
    tree: StaticTree,
    draft_logits: torch.Tensor | None = None,
) -> Candidates:
    """Draft from the last committed token's hidden state [hidden]: draft layer d proposes depth d,
    or with a path input (`path_candidates`) each node's children follow its own path.
    `draft_logits` [≥ depth, V], when the verify pass's LM-head pass already computed them, saves
    the head pass."""
    if drafts_along_paths(engine.draft_layers) and tree.depth > 1:
        return path_candidates(engine, state, hidden, tree)
    if draft_logits is None or draft_logits.shape[0] < tree.depth:
        root = to_device(state.tokens[-1:], torch.long, hidden.device)  # [1]: the root follows `hidden`
        draft_logits = engine.model.draft_logits(hidden[None], engine.draft_layers, tree.depth, root)[
            :, 0
        ]  # [depth, V]
    return top_candidates(draft_logits, state, tree)


def path_candidates(
    engine: Engine, state: DecodeState, hidden: torch.Tensor, tree: StaticTree
) -> dict[tuple[int, ...], list[int]]:
    """Draft the tree level by level along its own paths (draft layers with a path input): layer 1
    drafts the root's children from hidden [hidden] and the root; each further level drafts the
    children of every node of the level before from that node's state and token, one batch per
    level. Each row is ranked with its own path's penalty window and the noise of its position.
    -> per node (keyed by its candidate-rank path) its children's ids, best first."""
    layers, device = engine.draft_layers, hidden.device
    states = hidden[None]  # [1, hidden]
    frontier: list[tuple[tuple[int, ...], list[int]]] = [((), [])]  # (rank path, tokens after the root)
    tokens = [state.tokens[-1]]
    candidates: dict[tuple[int, ...], list[int]] = {}
    for depth, width in enumerate(tree.branching):
        states, logits = engine.model.path_logits(
            states, layers, to_device(tokens, torch.long, device), first=depth == 0
        )  # [F, hidden], [F, V]
        noise = None
        if state.random.noise_known_in_advance:
            noise = state.noise([state.root_position + 1 + depth] * len(frontier), logits.shape[-1], device)
        window = state.windows([path for _, path in frontier]) if depth else state.window()
        ranked = state.sampler.rank(logits, window, noise, width).tolist()  # [F, width]
        children: list[tuple[tuple[int, ...], list[int]]] = []
        for (ranks, path), ids in zip(frontier, ranked, strict=True):
            candidates[ranks] = ids
            children.extend((ranks + (rank,), path + [ids[rank]]) for rank in range(width))
        if depth + 1 < tree.depth:  # the next level reads each child's parent state and own token
            states = states.repeat_interleave(width, dim=0)
            frontier, tokens = children, [path[-1] for _, path in children]
    return candidates


def retrieve_suffix(state: DecodeState, remaining: int) -> list[int]:
    """What followed the longest earlier match of the committed text's end (root included), or of a
    substituted match (`suffix.SuffixIndex.propose`), when that match is at least `SUFFIX_MIN_MATCH`
    tokens long (shorter ones are the 4-grams' work): as many tokens as matched, at most `remaining` - 1
    (the bonus token is the last). [] when off or none."""
    if state.suffix is None:
        return []
    state.suffix.extend(state.tokens[len(state.suffix.tokens) :])  # every path appends to `tokens`
    return state.suffix.propose(remaining, SUFFIX_MIN_MATCH)


def retrieve_ngrams(state: DecodeState, first_tokens: Sequence[int], k: int) -> list[tuple[int, ...]]:
    """Top-k committed 4-grams starting with each distinct token of `first_tokens` (head 0's
    candidates: the depth-1 drafts, or the root when drafting from the verify pass)."""
    if state.table is None or k <= 0:
        return []
    paths: list[tuple[int, ...]] = []
    for token in dict.fromkeys(first_tokens):
        paths.extend(state.table.top(token, k))
    return paths


def verify(engine: Engine, state: DecodeState, trie: Trie) -> ForwardCalls:
    """One forward of every trie node on the full cache with the trie's ancestor mask."""
    device = engine.device
    tokens = to_device(trie.tokens, torch.long, device)
    positions = to_device([depth + state.root_position for depth in trie.depths], torch.long, device)
    return (yield from call_forward(state, tokens, positions, trie.mask()))


def commit(state: DecodeState, acceptance: Acceptance, verified: ForwardOutput) -> None:
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
        state.table.update(state.tokens, len(state.tokens) - state.ngram_exclusion)


def commit_chain(state: DecodeState, count: torch.Tensor, walk: Walk) -> None:
    """`commit` on the device, `count` (0-d) tokens committed before the iteration: the accepted
    chain's K/V moved into the committed slots after the root's, its tokens into the history (slots
    past the new count are rewritten before they are read)."""
    levels = torch.arange(walk.chain.numel(), device=count.device)
    length = count - 1  # the root's slot
    source, target = length + walk.chain, length + levels
    for cache_tensor in (state.full.keys, state.full.values):
        cache_tensor.index_copy_(2, target, cache_tensor.index_select(2, source))
    state.history.index_copy_(0, count + levels, walk.emitted)
