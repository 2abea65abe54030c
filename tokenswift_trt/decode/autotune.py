"""`--tree auto`: choose the draft tree and n-gram k that maximise tokens per second here.

During a probe phase decoding runs with the largest tree and k (`probe_plan`). For each
probe iteration we know, for every trie node, whether a smaller tree or k would also have had it
(its static-tree rank path and n-gram rank), so the acceptance length and trie size of every
candidate plan follow exactly from the probe's accepted path: the target's samples along a path
do not depend on which other nodes are in the trie. Then the verify forward is timed at the
current context for several trie sizes, and the plan with the most expected tokens per second
wins (plain AR steps are a candidate too). Every plan is lossless; only speed depends on it.

Between probes, the iterations of the chosen plan are recorded too, for the candidates that fit
inside it (their nodes are all in its trie): a probe's 16 iterations estimate acceptance to about
±0.1 tokens, and the plan that runs, with its smaller variants, gets thousands of samples more.

A cost model can be wrong (a verify pass timed at one context, trie shapes it did not time), and
plain AR steps are always a candidate, so a drafting plan the model picks is then tried for real:
it and plain AR steps take turns (TURNS of each: TRIAL_ITERATIONS drafting iterations and
AR_TRIAL_STEPS steps in all), and the drafting plan is kept only if it measured at least 3% fewer
seconds per token (TRIAL_MARGIN). Taking turns is what makes ~100 tokens a fair test on a machine
whose speed drifts by 10-30% over seconds (a CPU shared with other work): one block of each, one
after the other, measured the same SmolLM2 AR step at 17 ms in one trial and 23 ms in the next, and
dropped a tree that ran 1.2x faster than AR steps. A trial can still keep a plan that is slower
over thousands of tokens, so a kept plan is audited: after AUDIT_EVERY tokens (doubling after each
audit it passes) AR steps and the plan take turns again, and each audit judges on its own
(acceptance changes over a long generation: SmolLM2 continuing Pride and Prejudice accepts 1.5
tokens per iteration over the first 400 tokens, which the model partly knows, and ~1.15 later):
once the plan's seconds per token are not below the AR steps' by the trial's margin, AR steps run
until the next probe; once they are clearly below (AUDIT_CLEAR), the audits stop. Each audit costs
AR_TRIAL_STEPS tokens at AR speed.

Drafting from the verify pass, the probe costs (almost) nothing: decoding runs plain AR steps,
and after each one the tuner drafts the probe's trie from that step's hidden state, exactly as a
verify-mode iteration rooted at the new token would (same draft layers, same noise ranking, same
n-grams), then waits for the next tokens. Lossless verification accepts a node exactly when it is
the token AR sampling puts there, so the path the AR tokens take through that trie is the path a
real probe iteration would have accepted. What it costs is the draft layers' head pass and the
ranking per AR step (~10% of a SmolLM2 step on a CPU) instead of verifying a 16-node trie, which
on a CPU costs 2-3 AR steps. A separate draft pass (the paper's partial-cache drafting) is a whole
forward, so that probe still runs the probe tree for real.

The probe's estimates come from the tokens right after it, and a plan that runs only informs the
candidates inside it, so drafting from the verify pass the probe trie is also drafted on the AR
steps of every trial and audit (~10% of those steps): samples that score every candidate on the same
positions as the text goes on (`Tuner.shared`, with the probes'). After an audit the running plan
passes, the cost model (its costs from the last probe) is asked again on those samples alone; a plan
it expects to be at least 1 / TRIAL_MARGIN times faster is tried for real against AR steps, and if it
loses its trial the plan that passed its audit runs on (SmolLM2 on a CPU: the probe after the prompt
estimated `1,1` above `3`, which commits 1.61 tokens an iteration against 1.49 over 1,024 tokens).

`Tuner` holds all of that state; the decode loop asks it for the plan to run and reports each
iteration to it, and knows nothing of probes.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tokenswift_trt.decode.stages import (
    BATCHED_NODES_MAX,
    DecodeState,
    NodeTargets,
    candidates_from_hidden,
    forward_full,
    retrieve_ngrams,
    sample_next,
    sampled_in_one_batch,
    top_candidates,
)
from tokenswift_trt.decode.tree import StaticTree, Trie, build_static_tree, build_trie, parse_tree
from tokenswift_trt.model.decoder import drafts_along_paths, reads_root
from tokenswift_trt.model.engine import Engine

# The probe's tree and n-gram k by device type and drafting source ("partial": a separate draft pass
# on the partial cache, whose first level is the base model's one draft; "verify": depth d uses draft
# layer d). Probe iterations are the tuner's own overhead. On a GPU a verify of ~120 nodes costs
# about one step, so the largest tree and k are probed; on a CPU a verify costs about its node count
# and the plans that win are small (2, 3, 2,1, ...), so a smaller probe pays for itself.
PROBES: dict[tuple[str, str], tuple[str, int]] = {
    ("cuda", "partial"): ("1,3,3,3", 20),
    ("cuda", "verify"): ("3,3,3", 20),
    ("cpu", "partial"): ("1,3,2,1", 4),
    ("cpu", "verify"): ("3,2,1", 4),
}
# probe iterations with the largest tree: acceptance counts add up over probes and over the iterations of
# the plans that run; a probe is the tuner's overhead, and the trial catches a plan chosen on too few
PROBE_ITERATIONS = 16
SHADOW_PROBE_STEPS = 32  # a probe on AR steps (drafting from the verify pass): cheap, so twice as long
# Acceptance changes as a long generation goes on (text that starts to repeat makes n-gram branches
# pay; a kept plan only learns about the candidates inside it), and a probe drafting from the verify
# pass costs ~10% of 32 AR steps, so probes come often
RETUNE_EVERY = 2048  # probe again after this many new tokens
RETUNE_AFTER_AR = 512  # ... or this many after choosing plain AR steps (which teach the tuner nothing),
# doubling for every further probe in a row that ends in AR steps
TRIAL_ITERATIONS = 48  # the model's drafting plan, timed for real ...
AR_TRIAL_STEPS = 32  # ... against this many plain AR steps ...
TURNS = 4  # ... the two taking turns, this many of each (12 iterations, then 8 steps, ...)
# ... and kept only if it is this much faster per token: trials of ~50 tokens on a machine whose speed
# drifts by several percent cannot tell closer plans apart (SmolLM2 on the AVX2 CPU kept a tree `1`
# whose trial measured it faster, and it ran 3% slower than AR steps over 4,096 tokens)
TRIAL_MARGIN = 0.97
AUDIT_EVERY = 256  # tokens of a kept drafting plan before its first audit against AR steps (then doubling)
AUDIT_CLEAR = 0.85  # no more audits once the drafting plan's seconds per token is below this share of AR's
# Candidate trees; a probe considers those that fit inside its own tree (the paper's drafting probes
# 1,3,3,3, whose first level is the base model's one draft; drafting from the verify pass probes
# 3,3,3, whose first level is draft layer 1's, where a few first-level candidates can pay).
CANDIDATE_TREES = (
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
CANDIDATE_TOPK = (0, 1, 2, 4, 8, 20)
AR_PLAN = "ar"  # tree value of the plan that drafts nothing
# A drafting iteration costs at least an AR step (its verify pass) plus the drafting, so a probe whose
# best candidate commits fewer tokens per iteration than this settles on AR steps without timing
# verify passes (~20 forwards of the tuner's own overhead)
MIN_TOKENS_PER_ITERATION = 1.05
# On a CPU verify passes and batched sampling are timed up to this many nodes, larger ones extrapolated
CPU_TIMED_NODES = 8
# What exploring costs (the tuner's own work: shadow drafts, the choice's timing passes, recording; and
# what drafting iterations lose to AR steps' speed) is spent from a budget: this share of the
# generation's projected time (its decode seconds so far plus the tokens left at AR steps' speed), plus
# what drafting iterations saved. A probe starts (and goes on past its first step) only if its expected
# cost fits, so a generation where drafting never pays runs within this share of `--method ar`, however
# fast the step (swift-tiny on a CPU: a shadow draft costs half an AR step, a probe and its choice ~35
# AR steps, so generations shorter than ~2,000 tokens are not probed at all)
EXPLORATION_BUDGET = 0.02
CHOOSE_COST_STEPS = 30  # the first choice's timing passes, in AR steps, until one is measured (~16-40)


def probe_plan(draft_source: str, device: torch.device) -> tuple[str, int]:
    """(tree, n-gram k) the tuner probes with for this drafting source ("partial" / "verify") here."""
    return PROBES["cuda" if device.type == "cuda" else "cpu", draft_source]


@dataclass(frozen=True)
class Plan:
    """What the decode loop runs: a static tree and n-gram k, or plain AR steps (tree AR_PLAN)."""

    tree: str  # a tree string ("1,3,3,3"), or AR_PLAN
    ngram_topk: int
    from_token: int = 0  # new-token count when the plan started (Stats.plans)
    probe: bool = False  # the tuner's probe, run to measure acceptance
    trial: bool = False  # a turn of a trial: the model's pick or AR steps, timed against each other
    audit: bool = False  # a turn of an audit: AR steps or the kept drafting plan (`Tuner` audits)

    @functools.cached_property
    def branching(self) -> tuple[int, ...]:
        """Candidates per depth (parsed once: the tuner reads it every iteration of a drafting plan)."""
        return () if self.tree == AR_PLAN else parse_tree(self.tree)

    def static_tree(self) -> StaticTree | None:
        return None if self.tree == AR_PLAN else build_static_tree(self.branching)

    def __str__(self) -> str:
        if self.probe and self.tree == AR_PLAN:
            return f"probe on ar steps from token {self.from_token}"
        kind = "probe " if self.probe else "trial " if self.trial else "audit " if self.audit else ""
        return f"{kind}{self.tree} k={self.ngram_topk} from token {self.from_token}"


def describe_plans(plans: Sequence[Plan]) -> list[str]:
    """`Stats.plans` for people: the turns of a trial or an audit as one entry
    ("trial 3 k=0 against ar steps, 8 turns, from token 36")."""
    described: list[str] = []
    start = 0
    while start < len(plans):
        plan = plans[start]
        end = start + 1
        if not (plan.trial or plan.audit):
            described.append(str(plan))
            start = end
            continue
        while end < len(plans) and (plans[end].trial, plans[end].audit) == (plan.trial, plan.audit):
            end += 1
        drafting = next((turn for turn in plans[start:end] if turn.tree != AR_PLAN), plan)
        kind = "trial" if plan.trial else "audit"
        described.append(
            f"{kind} {drafting.tree} k={drafting.ngram_topk} against ar steps, {end - start} turns, "
            f"from token {plan.from_token}"
        )
        start = end
    return described


@dataclass(frozen=True)
class Estimate:
    """A candidate plan's expected tokens and seconds per iteration (`choose_plan`)."""

    tree: str  # a tree string, or AR_PLAN
    ngram_topk: int
    tokens_per_iteration: float
    seconds_per_iteration: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_iteration / self.seconds_per_iteration if self.seconds_per_iteration else 0.0


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

    def __init__(self, max_depth: int, probe_tree: str | None = None, probe_topk: int | None = None) -> None:
        """Candidates: CANDIDATE_TREES at most `max_depth` deep and, given the probe's tree and k,
        inside it (a candidate's nodes must all be in the probe's trie to be scored from it)."""
        probe = parse_tree(probe_tree) if probe_tree is not None else None

        def fits(branching: tuple[int, ...]) -> bool:
            if len(branching) > max_depth:
                return False
            return probe is None or (
                len(branching) <= len(probe) and all(b <= p for b, p in zip(branching, probe))
            )

        self.candidates = [
            (tree, parse_tree(tree), k)
            for tree in CANDIDATE_TREES
            if fits(parse_tree(tree))
            for k in CANDIDATE_TOPK
            if probe_topk is None or k <= probe_topk
        ]
        self.accepted = {(tree, k): 0 for tree, _, k in self.candidates}
        self.nodes = {(tree, k): 0 for tree, _, k in self.candidates}
        self.counts = {(tree, k): 0 for tree, _, k in self.candidates}  # iterations recorded per candidate
        self.iterations = 0  # probe iterations
        self._inside: dict[tuple[tuple[int, ...], int], list[tuple[str, tuple[int, ...], int]]] = {}

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
    ) -> list[tuple[str, tuple[int, ...], int]]:
        key = (branching, k)
        if key not in self._inside:
            self._inside[key] = [
                (tree, b, candidate_k)
                for tree, b, candidate_k in self.candidates
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
    recorder: ProbeRecorder,
    verify_costs: dict[int, float],
    draft_s: float,
    overhead_s: float,
    sampling_costs: dict[int, float] | None = None,
    device: torch.device = torch.device("cuda"),
    per_node_s: float = 0.0,
    batched_draft_s: float | None = None,
    draft_s_by_depth: dict[int, float] | None = None,
) -> tuple[Estimate, list[Estimate]]:
    """Best plan (and all, best first) from probe acceptance, verify costs and per-iteration costs.

    `sampling_costs` {N: seconds} is what sampling N verified nodes as one batch costs (measured);
    tries that `sampled_in_one_batch` says no to on `device` sample one node per visit instead,
    i.e. about one single-node cost per committed token. Without it the sampling is taken to be
    inside `overhead_s`, an AR step paying half of that. `per_node_s` is host work per trie node.
    `batched_draft_s`, when given, replaces `draft_s` for tries sampled as one batch (drafting from
    the verify pass, their drafts come out of that batch's head pass: only the ranking is left).
    `draft_s_by_depth` {tree depth: seconds}, when given, replaces both: drafting along tree paths
    (a path input) costs one pass per level, so a deep plan drafts for longer than a shallow one.
    """

    def sampling(nodes: float, tokens: float) -> float:
        if sampling_costs is None:
            return 0.0
        if not sampled_in_one_batch(nodes, device):
            return interpolate(sampling_costs, 1) * tokens
        return interpolate(sampling_costs, nodes)

    ar_overhead = sampling(1, 1) if sampling_costs is not None else overhead_s / 2
    plans = [Estimate(AR_PLAN, 0, 1.0, interpolate(verify_costs, 1) + ar_overhead)]
    for (tree, k), nodes in recorder.mean_nodes().items():
        tokens = 1 + recorder.mean_accepted((tree, k))
        batched = sampled_in_one_batch(nodes, device)
        draft = batched_draft_s if batched_draft_s is not None and batched else draft_s
        if draft_s_by_depth:
            draft = draft_s_by_depth[min(len(parse_tree(tree)), max(draft_s_by_depth))]
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


# ---------------------------------------------------------------- measured costs


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
    # to 16). On a CPU a verify costs about its size beyond a few tokens and the tries that can pay
    # are small, so sizes past CPU_TIMED_NODES are extrapolated instead of timed (a 16-node verify costs
    # ~3 AR steps, four of them a probe: SmolLM2's choice took 0.88 s of 19 s for 1,024 tokens)
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


# ---------------------------------------------------------------- the tuner


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


@dataclass
class _Trial:
    seconds: float = 0.0
    tokens: int = 0
    iterations: int = 0

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens

    def add(self, seconds: float, tokens: int, iterations: int = 1) -> None:
        self.seconds += seconds
        self.tokens += tokens
        self.iterations += iterations


@dataclass
class _Turns:
    """A trial or an audit in progress: the drafting plan `plan` and AR steps taking turns, each
    side timed on its own."""

    plan: Plan  # the drafting plan tried or audited
    audit: bool  # an audit starts with AR steps (the plan was running), a trial with the plan
    fallback: Plan  # what runs if a trial fails: AR steps, or the plan a re-choice would replace
    drafting: _Trial = field(default_factory=_Trial)
    ar: _Trial = field(default_factory=_Trial)
    in_turn: int = 0  # iterations of the running turn

    def side(self, ar: bool) -> tuple[_Trial, int]:
        """The timing of one side and the iterations it runs in all."""
        return (self.ar, AR_TRIAL_STEPS) if ar else (self.drafting, TRIAL_ITERATIONS)

    def side_done(self, ar: bool) -> bool:
        timing, total = self.side(ar)
        return timing.iterations >= total

    @property
    def ratio(self) -> float:
        """The drafting plan's seconds per token over AR steps'."""
        return self.drafting.seconds_per_token / self.ar.seconds_per_token


class Tuner:
    """`--tree auto`: probes, records acceptance, prices plans and says which plan runs next.

    The loop calls `plan` before an iteration and `observe` after it; every plan is lossless, so
    the tuner decides speed only.
    """

    def __init__(
        self, engine: Engine, state: DecodeState, from_verify: bool, max_trie: int, clock: Callable[[], int]
    ) -> None:
        self.engine, self.state, self.from_verify, self.max_trie = engine, state, from_verify, max_trie
        self.clock = clock  # new tokens so far (plans are logged by it)
        self.probe_tree, self.probe_topk = probe_plan("verify" if from_verify else "partial", engine.device)
        self._probe_static = build_static_tree(self.probe_tree)
        # probe tries drafted on AR steps, waiting for their tokens: (trie, root index, depth, costs or
        # None for a shadow drafted outside a probe)
        self._shadows: deque[tuple[Trie, int, int, IterationCosts | None]] = deque()
        max_depth = len(engine.draft_layers) + (0 if from_verify else 1)
        # kept over all probes
        self.recorder = ProbeRecorder(max_depth, self.probe_tree, self.probe_topk)
        # only the iterations that scored every candidate (probes, and the probe trie drafted on the AR
        # turns of trials and audits): the same positions for all, so they compare candidates without
        # the running plan's own text weighing on the plans inside it (`_rechoose`)
        self.shared = ProbeRecorder(max_depth, self.probe_tree, self.probe_topk)
        self._costs: dict | None = None  # the cost model's inputs at the last choice (`_choose`)
        self._shared_at_choice = 0  # shared iterations when the last choice was made
        self.history: list[Plan] = []
        self._probe_costs = IterationCosts(0.0, 0.0, 0.0, 0)
        self._probe_iterations = 0
        self._next_probe = 0
        self._ar_streak = 0  # probes in a row that ended in AR steps
        self._turns: _Turns | None = None  # the trial or audit in progress
        self._audits: int | None = None  # audits the kept drafting plan passed; None: none kept
        self._next_audit = 0  # token count at which the kept drafting plan is audited
        # the exploration budget (EXPLORATION_BUDGET), in seconds
        self._elapsed_s = 0.0  # of the iterations reported
        self._ar_s_per_token: float | None = None  # AR steps' recent speed
        self._spent_s = 0.0  # the tuner's own work (`observe`)
        self._saved_s = 0.0  # drafting iterations against AR steps' speed (negative: lost)
        self._shadow_s: float | None = None  # one shadow draft, on average
        self._choose_s: float | None = None  # the last choice
        self._start_probe()

    @property
    def plan(self) -> Plan:
        return self.history[-1]

    def _start_probe(self) -> None:
        """Drafting from the verify pass, on AR steps (see the module docstring); else the probe tree."""
        self._audits = None
        tree, topk = (AR_PLAN, 0) if self.from_verify else (self.probe_tree, self.probe_topk)
        self.history.append(Plan(tree, topk, max(1, self.clock()), probe=True))
        self._probe_costs, self._probe_iterations = IterationCosts(0.0, 0.0, 0.0, 0), 0
        self._shadows.clear()

    def _switch(self, tree: str, ngram_topk: int) -> None:
        self.history.append(Plan(tree, ngram_topk, self.clock()))

    def _settle(self, plan: Plan) -> None:
        self._switch(plan.tree, plan.ngram_topk)
        self._ar_streak = self._ar_streak + 1 if plan.tree == AR_PLAN else 0
        self._schedule_probe()
        self._next_audit = len(self.state.tokens) + AUDIT_EVERY

    def _schedule_probe(self) -> None:
        wait = RETUNE_AFTER_AR * 2 ** (self._ar_streak - 1) if self.plan.tree == AR_PLAN else RETUNE_EVERY
        self._next_probe = len(self.state.tokens) + wait

    def plain_ar_steps(self) -> int:
        """AR steps the loop may run as `--method ar` does before it reports them (as one iteration):
        while the tuner has settled on AR steps, those up to its next probe; else 0 (report each)."""
        plan = self.plan
        if plan.tree != AR_PLAN or plan.probe or plan.trial or plan.audit:
            return 0
        return max(1, self._next_probe - len(self.state.tokens))

    def _allowance(self) -> float:
        """Seconds the budget has left (EXPLORATION_BUDGET)."""
        left = (self.state.limit - len(self.state.tokens)) * (self._ar_s_per_token or 0.0)
        return EXPLORATION_BUDGET * (self._elapsed_s + left) + self._saved_s - self._spent_s

    def _probe_cost(self, steps: int) -> float:
        """Expected seconds of `steps` more probe steps on AR steps and the choice after them."""
        step = self._ar_s_per_token or 0.0
        choose = self._choose_s if self._choose_s is not None else CHOOSE_COST_STEPS * step
        return steps * (self._shadow_s or 0.0) + choose

    def observe(
        self,
        trie: Trie | None,
        accepted_nodes: Sequence[int],
        costs: IterationCosts | None,
        last_hidden: torch.Tensor,
        done: bool,
        seconds: float = 0.0,
        tokens: int = 1,
    ) -> Plan:
        """Record one finished iteration (trie None: plain AR steps, `tokens` of them) that took
        `seconds` and committed `tokens`; returns the plan to run next. What this costs is spent from
        the exploration budget."""
        started = time.perf_counter()
        plan = self._account(trie is None, seconds, tokens)
        if (
            plan.tree == AR_PLAN
            and self.from_verify
            and (plan.trial or plan.audit)
            and (self._shadow_s or 0.0) <= self._allowance()
        ):
            self._shadow_draft(last_hidden, probe=False)  # every candidate scored, ~10% of a step
        if plan.probe:
            if plan.tree == AR_PLAN:
                self._shadow_draft(last_hidden, probe=True)
                needed = SHADOW_PROBE_STEPS
                if self._probe_iterations == 1 and self._probe_cost(needed - 1) > self._allowance():
                    self._settle(Plan(AR_PLAN, 0))  # the probe would cost more than the budget has
                    self._spent_s += time.perf_counter() - started
                    return self.plan
            else:  # a probe tree runs every iteration
                assert trie is not None and costs is not None
                self._record_probe(trie, accepted_nodes, costs)
                needed = PROBE_ITERATIONS
            if self._probe_iterations >= needed and not done:
                self._choose(last_hidden)
        else:
            self._settle_shadows()
            if trie is not None and not done:  # the running plan's iterations count too
                self.recorder.record(trie, accepted_nodes, (plan.branching, plan.ngram_topk))
            if plan.trial or plan.audit:
                self._time_turn(plan, seconds, tokens)
        settled = not (self.plan.probe or self.plan.trial or self.plan.audit)
        if settled and len(self.state.tokens) >= self._next_probe:
            if self._probe_cost(SHADOW_PROBE_STEPS) <= self._allowance():
                self._start_probe()
            else:
                self._schedule_probe()
        elif settled and self._audits is not None and len(self.state.tokens) >= self._next_audit:
            self._start_turns(self.plan, audit=True)
        self._spent_s += time.perf_counter() - started
        return self.plan

    def _account(self, ar_steps: bool, seconds: float, tokens: int) -> Plan:
        """The budget's side of an iteration: AR steps update their speed, a drafting iteration
        saves (or loses) against it."""
        self._elapsed_s += seconds
        if ar_steps:
            per_token = seconds / max(1, tokens)
            previous = self._ar_s_per_token
            self._ar_s_per_token = (
                per_token if previous is None else previous + (per_token - previous) * min(1.0, tokens / 64)
            )
        elif self._ar_s_per_token is not None:
            self._saved_s += tokens * self._ar_s_per_token - seconds
        return self.plan

    def _shadow_draft(self, hidden: torch.Tensor, probe: bool) -> None:
        """After an AR step (hidden [hidden]: the step's input token's, which sampled the new root):
        draft the probe trie at the new root as a verify-mode iteration would, and record every
        earlier one whose continuation the tokens now cover; `probe`: one of the probe's own
        iterations (else a trial's or audit's AR turn: recorded, not a probe iteration)."""
        engine, state = self.engine, self.state
        if state.table is not None:  # AR steps leave the n-gram table behind; the trie needs it
            state.table.update(state.tokens, len(state.tokens) - state.ngram_exclusion)
        tick = time.perf_counter()
        candidates = candidates_from_hidden(engine, state, hidden, self._probe_static)
        drafted = time.perf_counter()
        ngrams = retrieve_ngrams(state, state.tokens[-1:], self.probe_topk)
        trie = build_trie(state.tokens[-1], self._probe_static, candidates, ngrams, ngrams_from_root=True)
        done = time.perf_counter()
        costs = IterationCosts(drafted - tick, done - drafted, 0.0, len(trie))
        previous = self._shadow_s
        self._shadow_s = done - tick if previous is None else previous + (done - tick - previous) / 8
        self._shadows.append((trie, len(state.tokens) - 1, max(trie.depths), costs if probe else None))
        self._settle_shadows()

    def _settle_shadows(self) -> None:
        """Record the shadow tries whose `depth` tokens after the root are now committed."""
        tokens = self.state.tokens
        while self._shadows and len(tokens) - 1 - self._shadows[0][1] >= self._shadows[0][2]:
            trie, root, depth, costs = self._shadows.popleft()
            accepted = accepted_path(trie, tokens[root + 1 : root + 1 + depth])
            if costs is None:
                self.recorder.record(trie, accepted)
                self.shared.record(trie, accepted)
            else:
                self._record_probe(trie, accepted, costs)

    def _record_probe(self, trie: Trie, accepted_nodes: Sequence[int], costs: IterationCosts) -> None:
        self.recorder.record(trie, accepted_nodes)
        self.shared.record(trie, accepted_nodes)
        totals = self._probe_costs
        totals.draft_s += costs.draft_s
        totals.trie_s += costs.trie_s
        totals.commit_s += costs.commit_s
        totals.nodes += costs.nodes
        self._probe_iterations += 1

    def _start_turns(self, plan: Plan, audit: bool, fallback: Plan | None = None) -> None:
        """A trial of `plan` (the model's pick; it runs first) or an audit of it (kept; AR steps first);
        a trial that fails settles on `fallback` (default: AR steps)."""
        self._turns = _Turns(plan, audit, fallback or Plan(AR_PLAN, 0))
        self._turn_to(ar=audit)

    def _turn_to(self, ar: bool) -> None:
        turns = self._turns
        assert turns is not None
        turns.in_turn = 0
        tree, topk = (AR_PLAN, 0) if ar else (turns.plan.tree, turns.plan.ngram_topk)
        self.history.append(Plan(tree, topk, self.clock(), trial=not turns.audit, audit=turns.audit))

    def _time_turn(self, plan: Plan, seconds: float, tokens: int) -> None:
        """One iteration of a trial or audit: timed to its side; the sides take turns of
        1/TURNS of their iterations; once both have run all of theirs, the trial or audit ends."""
        turns = self._turns
        assert turns is not None
        ar = plan.tree == AR_PLAN
        timing, total = turns.side(ar)
        timing.add(seconds, tokens)
        turns.in_turn += 1
        if turns.side_done(ar) and turns.side_done(not ar):
            self._turns = None
            if turns.audit:
                self._end_audit(turns)
            else:
                self._end_trial(turns)
        elif not turns.side_done(not ar) and (turns.in_turn >= -(-total // TURNS) or turns.side_done(ar)):
            self._turn_to(ar=not ar)

    def _end_trial(self, turns: _Turns) -> None:
        """Keep the drafting plan if it was clearly faster than AR steps, else settle on AR steps."""
        if turns.ratio < TRIAL_MARGIN:
            self._settle(turns.plan)
            self._audits = 0
        else:  # AR steps, or the plan that was running when a re-choice tried this one
            self._settle(turns.fallback)
            self._audits = None if turns.fallback.tree == AR_PLAN else 0

    def _end_audit(self, turns: _Turns) -> None:
        """Keep the drafting plan while it stays faster than AR steps, judged on this audit alone
        (taking turns makes one fair; acceptance changes over a long generation, and a plan that paid
        early on is not carried by its past)."""
        assert self._audits is not None
        if turns.ratio >= TRIAL_MARGIN:  # the margin it had to win its trial by, kept up
            self._audits = None
            self._settle(Plan(AR_PLAN, 0))
            return
        self._audits += 1
        better = self._rechoose(turns.plan)
        if better is not None:  # tried for real; the plan that passed its audit runs if it loses
            self._start_turns(better, audit=False, fallback=Plan(turns.plan.tree, turns.plan.ngram_topk))
            return
        self._switch(turns.plan.tree, turns.plan.ngram_topk)
        clear = turns.ratio < AUDIT_CLEAR
        self._next_audit = (
            self._next_probe if clear else len(self.state.tokens) + AUDIT_EVERY * 2**self._audits
        )

    def _rechoose(self, running: Plan) -> Plan | None:
        """After a passed audit: a drafting plan the cost model, fed the samples every candidate shares
        (probes and the AR turns since), expects to run at least 1 / TRIAL_MARGIN times faster than
        `running`; None when there is none or nothing new was sampled since the last choice. The
        probe's estimates come from its first tokens, and a plan that runs only learns about the
        candidates inside it: these samples follow the text as it goes on."""
        if self._costs is None or self.shared.iterations <= self._shared_at_choice:
            return None
        self._shared_at_choice = self.shared.iterations
        best, plans = choose_plan(self.shared, **self._costs)
        current = next(
            (p for p in plans if (p.tree, p.ngram_topk) == (running.tree, running.ngram_topk)), None
        )
        if (
            best.tree == AR_PLAN
            or current is None
            or (best.tree, best.ngram_topk) == (current.tree, current.ngram_topk)
        ):
            return None
        if best.tokens_per_s * TRIAL_MARGIN < current.tokens_per_s:
            return None
        return Plan(best.tree, best.ngram_topk)

    def _choose(self, last_hidden: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            self._choose_measured(last_hidden)
        finally:
            self._choose_s = time.perf_counter() - started

    def _choose_measured(self, last_hidden: torch.Tensor) -> None:
        engine, state, count = self.engine, self.state, self._probe_iterations
        recorder = self.recorder
        if max(1 + recorder.mean_accepted(key) for key in recorder.accepted) < MIN_TOKENS_PER_ITERATION:
            self._settle(Plan(AR_PLAN, 0))
            return
        totals = self._probe_costs
        verify_costs = measure_verify(engine, state, self.max_trie)
        # drafting from the verify pass the head pass carries draft rows (one level: the trees CPUs pick)
        sampling = measure_sampling(engine, state, last_hidden, 1 if self.from_verify else 0)
        self._costs = dict(
            verify_costs=verify_costs,
            draft_s=totals.draft_s / count,
            overhead_s=totals.commit_s / count,
            sampling_costs=sampling,
            device=engine.device,
            per_node_s=totals.trie_s / totals.nodes,  # building a trie (n-grams included)
            # root-conditioned layers read each node's sample: their head pass is not batched
            batched_draft_s=(
                measure_ranking(engine, state, last_hidden)
                if self.from_verify and not reads_root(engine.draft_layers)
                else None
            ),
            draft_s_by_depth=(
                measure_path_drafting(engine, state, last_hidden, self._probe_static)
                if self.from_verify and drafts_along_paths(engine.draft_layers)
                else None
            ),
        )
        self._shared_at_choice = self.shared.iterations
        best, _ = choose_plan(self.recorder, **self._costs)
        if best.tree == AR_PLAN:
            self._settle(Plan(AR_PLAN, 0))
        else:  # timed for real against plain AR steps before it is kept
            self._start_turns(Plan(best.tree, best.ngram_topk), audit=False)
