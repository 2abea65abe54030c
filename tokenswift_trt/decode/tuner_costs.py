"""What a plan would commit and cost here: the `--tree auto` tuner's measurements and cost model.

A probe iteration's accepted path scores every candidate plan at once (`ProbeRecorder`): for each
trie node we know whether a smaller tree or n-gram k would also have had it (its static-tree rank
path and n-gram rank), and the target's samples along a path do not depend on which other nodes
are in the trie, so each candidate's acceptance length and trie size follow exactly. The verify
forward, the sampling and the drafting are timed at the current context (`measure_*`), and
`choose_plan` prices every candidate, plain AR steps included, in expected tokens per second.
Which plan runs, and when it is judged again, is the policy's (autotune.py).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenswift_trt.decode.stages import (
    BATCHED_NODES_MAX,
    DecodeState,
    NodeTargets,
    candidates_from_hidden,
    forward_full,
    sample_next,
    sampled_in_one_batch,
    top_candidates,
)
from tokenswift_trt.decode.tree import StaticTree, TreeSpec, Trie, build_static_tree, build_trie
from tokenswift_trt.model.engine import Engine

AR_TEXT = "ar"  # how output shows the tree of a plan that drafts nothing (tree None)
# Candidate trees; a probe considers those that fit inside its own tree (the paper's drafting probes
# 1,3,3,3, whose first level is the base model's one draft; drafting from the verify pass probes
# 3,3,3, whose first level is draft layer 1's, where a few first-level candidates can pay).
CANDIDATE_TREES: tuple[TreeSpec, ...] = tuple(
    TreeSpec.parse(tree)
    for tree in (
        "1",
        "1,1",
        "1,1,1",
        "1,1,1,1",
        "1,2,1,1",
        "1,2,2,1",
        "1,2,2,2",
        "1,3,2,2",
        "1,3,3,2",
        "1,3,3,3",
        "2",
        "3",
        "2,1",
        "3,1",
        "2,2",
        "3,2",
        "3,3",
        "2,1,1",
        "3,1,1",
        "3,2,1",
    )
)
CANDIDATE_TOPK = (0, 1, 2, 4, 8, 20)

# On a CPU verify passes and batched sampling are timed up to this many nodes, larger ones extrapolated
# (past a few rows a CPU verify costs about its size: 16 rows give the slope a long match's branch needs)
CPU_TIMED_NODES = 16


@dataclass(frozen=True)
class Estimate:
    """A candidate plan's expected tokens and seconds per iteration (`choose_plan`)."""

    tree: TreeSpec | None  # a static tree, or None: plain AR steps
    ngram_topk: int
    tokens_per_iteration: float
    seconds_per_iteration: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_iteration / self.seconds_per_iteration if self.seconds_per_iteration else 0.0


def tree_text(tree: TreeSpec | None) -> str:
    """A plan's tree as output shows it: its widths ("1,3,3,3"), or "ar" for plain AR steps (None)."""
    return AR_TEXT if tree is None else str(tree)


def _available(
    tree_path: tuple[int, ...] | None, ngram_rank: int | None, branching: tuple[int, ...], k: int
) -> bool:
    in_tree = (
        tree_path is not None
        and len(tree_path) <= len(branching)
        and all(rank < branching[depth] for depth, rank in enumerate(tree_path))
    )
    return in_tree or (ngram_rank is not None and ngram_rank < k)


class ProbeRecorder:
    """Accumulates, per candidate plan, accepted length and trie size over probe iterations."""

    def __init__(
        self, max_depth: int, probe_tree: TreeSpec | None = None, probe_topk: int | None = None
    ) -> None:
        """Candidates: CANDIDATE_TREES at most `max_depth` deep and, given the probe's tree and k,
        inside it (a candidate's nodes must all be in the probe's trie to be scored from it)."""
        probe = probe_tree.branching if probe_tree is not None else None

        def fits(branching: tuple[int, ...]) -> bool:
            if len(branching) > max_depth:
                return False
            return probe is None or (
                len(branching) <= len(probe) and all(b <= p for b, p in zip(branching, probe))
            )

        self.candidates = [
            (tree, tree.branching, k)
            for tree in CANDIDATE_TREES
            if fits(tree.branching)
            for k in CANDIDATE_TOPK
            if probe_topk is None or k <= probe_topk
        ]
        self.accepted = {(tree, k): 0 for tree, _, k in self.candidates}
        self.nodes = {(tree, k): 0 for tree, _, k in self.candidates}
        self.counts = {(tree, k): 0 for tree, _, k in self.candidates}  # iterations recorded per candidate
        self.iterations = 0  # probe iterations
        self._inside: dict[tuple[tuple[int, ...], int], list[tuple[TreeSpec, tuple[int, ...], int]]] = {}

    def record(
        self, trie: Trie, accepted_nodes: Sequence[int], plan: tuple[tuple[int, ...], int] | None = None
    ) -> None:
        """One iteration: a probe's (every candidate), or with `plan` = (branching, k) one of that
        plan's, which informs only the candidates inside it (every node they would verify was verified)."""
        if plan is None:
            self.iterations += 1
            candidates = self.candidates
        else:
            candidates = self._candidates_inside(*plan)
        features = list(zip(trie.tree_paths, trie.ngram_ranks))
        for tree, branching, k in candidates:
            self.counts[(tree, k)] += 1
            size = 1 + sum(_available(p, r, branching, k) for p, r in features[1:])
            length = 0
            for node in accepted_nodes:
                if not _available(trie.tree_paths[node], trie.ngram_ranks[node], branching, k):
                    break
                length += 1
            self.accepted[(tree, k)] += length
            self.nodes[(tree, k)] += size

    def _candidates_inside(
        self, branching: tuple[int, ...], k: int
    ) -> list[tuple[TreeSpec, tuple[int, ...], int]]:
        key = (branching, k)
        if key not in self._inside:
            self._inside[key] = [
                (tree, b, candidate_k)
                for tree, b, candidate_k in self.candidates
                if candidate_k <= k and len(b) <= len(branching) and all(x <= y for x, y in zip(b, branching))
            ]
        return self._inside[key]

    def mean_nodes(self) -> dict[tuple[TreeSpec, int], float]:
        return {key: value / max(1, self.counts[key]) for key, value in self.nodes.items()}

    def mean_accepted(self, key: tuple[TreeSpec, int]) -> float:
        return self.accepted[key] / max(1, self.counts[key])


def interpolate(costs: dict[int, float], size: float) -> float:
    """Piecewise-linear cost at `size` from measured {trie size: seconds}."""
    points = sorted(costs.items())
    if size <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if size <= x1:
            return y0 + (y1 - y0) * (size - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (size - x1) / (x1 - x0)


def time_verify(forward, sizes: Sequence[int], repeats: int = 3) -> dict[int, float]:
    """Median seconds of `forward(size)` for each size (forward runs one masked verify pass).

    Rounds go over every size in turn (not all repeats of one size, then the next), so that a
    machine whose speed drifts between moments charges the drift to every size alike: plans are
    chosen on ratios of these costs, and a few percent decide between drafting and AR steps.
    """
    for size in sizes:
        forward(size)  # warm
    samples: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(repeats):
        for size in sizes:
            if torch.cuda.is_available():  # queued work (the warm-up, the last sample) is not this sample's
                torch.cuda.synchronize()
            start = time.perf_counter()
            forward(size)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            samples[size].append(time.perf_counter() - start)
    return {size: statistics.median(values) for size, values in samples.items()}


def choose_plan(
    recorder: ProbeRecorder,
    verify_costs: dict[int, float],
    draft_s: float,
    overhead_s: float,
    sampling_costs: dict[int, float] | None = None,
    device: torch.device = torch.device("cuda"),
    per_node_s: float = 0.0,
    batched_draft_s: float | None = None,
    draft_s_by_depth: dict[int, float] | None = None,
    chain_rows: int = 1,
) -> tuple[Estimate, list[Estimate]]:
    """Best plan (and all, best first) from probe acceptance, verify costs and per-iteration costs.

    `sampling_costs` {N: seconds} is what sampling N verified nodes as one batch costs (measured);
    tries that `sampled_in_one_batch` says no to on `device` sample one node per visit instead,
    i.e. about one single-node cost per committed token, or per `chain_rows` committed tokens where a
    visit samples that many nodes down its path in one pass (`stages.chain_rows`). Without it the
    sampling is taken to be inside `overhead_s`, an AR step paying half of that. `per_node_s` is host
    work per trie node.
    `batched_draft_s`, when given, replaces `draft_s` for tries sampled as one batch (drafting from
    the verify pass, their drafts come out of that batch's head pass: only the ranking is left).
    `draft_s_by_depth` {tree depth: seconds}, when given, replaces both: drafting along tree paths
    (a path input) costs one pass per level, so a deep plan drafts for longer than a shallow one.
    """

    def sampling(nodes: float, tokens: float) -> float:
        if sampling_costs is None:
            return 0.0
        if not sampled_in_one_batch(nodes, device):  # a few rows of one pass cost what one does
            return interpolate(sampling_costs, 1) * math.ceil(tokens / chain_rows)
        return interpolate(sampling_costs, nodes)

    ar_overhead = sampling(1, 1) if sampling_costs is not None else overhead_s / 2
    plans = [Estimate(None, 0, 1.0, interpolate(verify_costs, 1) + ar_overhead)]
    for (tree, k), nodes in recorder.mean_nodes().items():
        tokens = 1 + recorder.mean_accepted((tree, k))
        batched = sampled_in_one_batch(nodes, device)
        draft = batched_draft_s if batched_draft_s is not None and batched else draft_s
        if draft_s_by_depth:
            draft = draft_s_by_depth[min(len(tree.branching), max(draft_s_by_depth))]
        seconds = (
            draft
            + overhead_s
            + per_node_s * nodes
            + interpolate(verify_costs, nodes)
            + sampling(nodes, tokens)
        )
        plans.append(Estimate(tree, k, tokens, seconds))
    plans.sort(key=lambda plan: -plan.tokens_per_s)
    return plans[0], plans


def measure_verify(engine: Engine, state: DecodeState, max_size: int) -> dict[int, float]:
    """Seconds of one verify forward at the current context for several trie sizes."""
    device = engine.device
    root_position = state.root_position

    def forward(size: int) -> None:
        tokens = torch.full((size,), state.tokens[-1], dtype=torch.long, device=device)
        positions = torch.arange(root_position, root_position + size, device=device)
        forward_full(engine, state, tokens, positions)
        state.full.pending = 0  # timing only: nothing written is kept

    # small sizes too: with a tree-attention kernel a few tokens cost what one does (not a straight line
    # to 16). On a CPU a verify costs about its size beyond a few tokens, so sizes past CPU_TIMED_NODES
    # are extrapolated from the last two instead of timed (a 16-node verify costs ~2 AR steps, a 32-node
    # one ~4: docs/bench/cpu-verify-rows)
    largest = max_size if device.type == "cuda" else min(max_size, CPU_TIMED_NODES)
    sizes = sorted({s for s in (1, 2, 4, 8, 16, 48) if s <= largest} | {largest})
    return time_verify(forward, sizes, repeats=5 if device.type == "cuda" else 3)


def measure_ranking(engine: Engine, state: DecodeState, hidden: torch.Tensor) -> float:
    """Seconds to draft from logits the verify pass's head pass already holds (transforms and
    noise ranking of one draft level): the whole drafting cost of a batched trie in verify mode."""
    logits = engine.model.draft_logits(hidden[None], engine.draft_layers, 1)[:, 0]  # [1, V]
    tree = build_static_tree("3")
    return time_verify(lambda _: top_candidates(logits, state, tree), [1], repeats=3)[1]


def measure_path_drafting(
    engine: Engine, state: DecodeState, hidden: torch.Tensor, tree: StaticTree
) -> dict[int, float]:
    """Seconds to draft the first d levels of `tree` along its paths (a path input: one draft pass
    per level, `stages.path_candidates`; one level is layer 1's pass alone) for d = 1..depth."""

    def draft(depth: int) -> None:
        candidates_from_hidden(engine, state, hidden, build_static_tree(tree.branching[:depth]))

    return time_verify(draft, list(range(1, tree.depth + 1)), repeats=3)


def measure_sampling(
    engine: Engine, state: DecodeState, hidden: torch.Tensor, draft_depth: int
) -> dict[int, float]:
    """Seconds to turn verified rows into the target's samples: N = 1 is an AR step's (`sample_next`);
    N = 2..BATCHED_NODES_MAX a trie of N nodes sampled as one batch (LM-head pass with `draft_depth`
    draft rows per node, transforms, noise, one read). hidden [hidden] stands in for every node."""

    def sample(size: int) -> None:
        if size == 1:
            sample_next(engine, state, hidden)
            return
        trie = build_trie(state.tokens[-1], build_static_tree(str(size - 1)), [list(range(size - 1))])
        NodeTargets(engine, state, trie, hidden.expand(size, -1).contiguous(), draft_depth).sample(0)

    largest = BATCHED_NODES_MAX if engine.device.type == "cuda" else CPU_TIMED_NODES
    return time_verify(sample, sorted({1, 2, 4, 8, largest}), repeats=5)


def accepted_path(trie: Trie, continuation: Sequence[int]) -> list[int]:
    """The nodes lossless verification of `trie` accepts when the target samples `continuation`
    after its root: each node whose token is the next one sampled, from the root down."""
    nodes, node = [], 0
    for token in continuation:
        child = trie.children[node].get(token)
        if child is None:
            break
        nodes.append(child)
        node = child
    return nodes


@dataclass
class IterationCosts:
    """Host work of one drafting iteration, as the loop timed it."""

    draft_s: float
    trie_s: float
    commit_s: float
    nodes: int
