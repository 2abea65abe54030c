"""`--tree auto`: choose the draft tree and n-gram k that maximise tokens per second here.

During a probe phase decoding runs with the largest tree (PROBE_TREE, k = PROBE_TOPK). For each
probe iteration we know, for every trie node, whether a smaller tree or k would also have had it
(its static-tree rank path and n-gram rank), so the acceptance length and trie size of every
candidate plan follow exactly from the probe's accepted path: the target's samples along a path
do not depend on which other nodes are in the trie. Then the verify forward is timed at the
current context for several trie sizes, and the plan with the most expected tokens per second
wins (plain AR steps are a candidate too). Every plan is lossless; only speed depends on it.

Between probes, the iterations of the chosen plan are recorded too, for the candidates that fit
inside it (their nodes are all in its trie): a probe's 32 iterations estimate acceptance to about
±0.08 tokens, and the plan that runs, with its smaller variants, gets thousands of samples more.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tree import Trie, parse_tree

PROBE_TREE = "1,3,3,3"
PROBE_TOPK = 20
# Candidate trees; a probe considers those that fit inside its own tree (the paper's drafting probes
# 1,3,3,3, whose first level is the base model's one draft; drafting from the verify pass probes
# 3,3,3, whose first level is draft layer 1's, where a few first-level candidates can pay).
CANDIDATE_TREES = (
    "1", "1,1", "1,1,1", "1,1,1,1", "1,2,1,1", "1,2,2,1", "1,2,2,2", "1,3,2,2", "1,3,3,2", "1,3,3,3",
    "2", "3", "2,1", "3,1", "2,2", "3,2", "3,3", "2,1,1", "3,1,1", "3,2,1",
)
CANDIDATE_TOPK = (0, 1, 2, 4, 8, 20)
AR_PLAN = "ar"  # tree value of the plan that drafts nothing


@dataclass(frozen=True)
class Plan:
    tree: str  # a tree string, or "ar"
    ngram_topk: int
    tokens_per_iteration: float
    seconds_per_iteration: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_iteration / self.seconds_per_iteration if self.seconds_per_iteration else 0.0


def _available(tree_path: tuple[int, ...] | None, ngram_rank: int | None, branching: tuple[int, ...], k: int) -> bool:
    in_tree = tree_path is not None and len(tree_path) <= len(branching) and all(
        rank < branching[depth] for depth, rank in enumerate(tree_path)
    )
    return in_tree or (ngram_rank is not None and ngram_rank < k)


class ProbeRecorder:
    """Accumulates, per candidate plan, accepted length and trie size over probe iterations."""

    def __init__(self, max_depth: int, probe_tree: str | None = None) -> None:
        """Candidates: CANDIDATE_TREES at most `max_depth` deep and, given the probe's tree, inside it."""
        probe = parse_tree(probe_tree) if probe_tree is not None else None

        def fits(branching: tuple[int, ...]) -> bool:
            if len(branching) > max_depth:
                return False
            return probe is None or (len(branching) <= len(probe) and all(b <= p for b, p in zip(branching, probe)))

        self.candidates = [(tree, parse_tree(tree), k) for tree in CANDIDATE_TREES if fits(parse_tree(tree)) for k in CANDIDATE_TOPK]
        self.accepted = {(tree, k): 0 for tree, _, k in self.candidates}
        self.nodes = {(tree, k): 0 for tree, _, k in self.candidates}
        self.counts = {(tree, k): 0 for tree, _, k in self.candidates}  # iterations recorded per candidate
        self.iterations = 0  # probe iterations
        self._inside: dict[tuple[tuple[int, ...], int], list[tuple[str, tuple[int, ...], int]]] = {}

    def record(self, trie: Trie, accepted_nodes: Sequence[int], plan: tuple[tuple[int, ...], int] | None = None) -> None:
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

    def _candidates_inside(self, branching: tuple[int, ...], k: int) -> list[tuple[str, tuple[int, ...], int]]:
        key = (branching, k)
        if key not in self._inside:
            self._inside[key] = [
                (tree, b, candidate_k) for tree, b, candidate_k in self.candidates
                if candidate_k <= k and len(b) <= len(branching) and all(x <= y for x, y in zip(b, branching))
            ]
        return self._inside[key]

    def mean_nodes(self) -> dict[tuple[str, int], float]:
        return {key: value / max(1, self.counts[key]) for key, value in self.nodes.items()}

    def mean_accepted(self, key: tuple[str, int]) -> float:
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
    recorder: ProbeRecorder, verify_costs: dict[int, float], draft_s: float, overhead_s: float,
    sampling_costs: dict[int, float] | None = None, lazy_above: int | None = None, per_node_s: float = 0.0,
    batched_draft_s: float | None = None,
) -> tuple[Plan, list[Plan]]:
    """Best plan (and all, best first) from probe acceptance, verify costs and per-iteration costs.

    `sampling_costs` {N: seconds} is what sampling N verified nodes as one batch costs (measured);
    tries above `lazy_above` nodes sample one node per visit instead, i.e. about one single-node
    cost per committed token. Without it the sampling is taken to be inside `overhead_s`, an AR
    step paying half of that. `per_node_s` is host work per trie node (building it).
    `batched_draft_s`, when given, replaces `draft_s` for tries sampled as one batch (drafting from
    the verify pass, their drafts come out of that batch's head pass: only the ranking is left).
    """
    def sampling(nodes: float, tokens: float) -> float:
        if sampling_costs is None:
            return 0.0
        if lazy_above is not None and nodes > lazy_above:
            return interpolate(sampling_costs, 1) * tokens
        return interpolate(sampling_costs, nodes)

    ar_overhead = sampling(1, 1) if sampling_costs is not None else overhead_s / 2
    plans = [Plan(AR_PLAN, 0, 1.0, interpolate(verify_costs, 1) + ar_overhead)]
    for (tree, k), nodes in recorder.mean_nodes().items():
        tokens = 1 + recorder.mean_accepted((tree, k))
        batched = lazy_above is None or nodes <= lazy_above
        draft = batched_draft_s if batched_draft_s is not None and batched else draft_s
        seconds = draft + overhead_s + per_node_s * nodes + interpolate(verify_costs, nodes) + sampling(nodes, tokens)
        plans.append(Plan(tree, k, tokens, seconds))
    plans.sort(key=lambda plan: -plan.tokens_per_s)
    return plans[0], plans
