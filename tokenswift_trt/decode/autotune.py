"""`--tree auto`: which plan (a draft tree and n-gram k, or plain AR steps) runs next, on this machine's
own timings. Every plan is lossless; the tuner decides speed only.

`Policy` holds the decisions, in five phases:

    start ──> PROBE ──(the choice is AR steps; or the probe would overrun the budget)──> AR
                │
                │ the choice is a drafting plan
                v
              TRIAL ──(lost, its fallback AR steps)──────────────────────────────────> AR
                │   └─(lost, its fallback the plan it would replace)─────────────────> DRAFT
                │ won
                v
              DRAFT ──(audit due)──> AUDIT ──(lost)──────────────────────────────────> AR
                │                      ├─(passed)────────────────────────────────────> DRAFT
                │                      └─(passed; the samples since favour another)──> TRIAL
                └──(probe due, within budget)──> PROBE

              AR ──(probe due: within budget)──> PROBE;  (over budget)──> AR, put off again

- PROBE measures acceptance. Drafting from the verify pass it runs plain AR steps and drafts the probe
  trie after each one from that step's hidden state ("shadow" drafts), as a verify-mode iteration
  rooted at the new token would: the path the AR tokens take through it is the path a real probe
  iteration would have accepted, for ~10% of a step instead of a 16-node verify (2-3 AR steps on a
  CPU). A separate draft pass (partial-cache drafting) runs the probe tree for real. Its end asks the
  cost model (tuner_costs.py): acceptance of every candidate from the probe's samples, the verify
  forward and sampling timed here at the current context, the best plan in tokens per second.
- TRIAL times the model's pick for real: it and plain AR steps take turns (TURNS of each,
  TRIAL_ITERATIONS iterations and AR_TRIAL_STEPS steps in all), and it is kept only if it measured at
  least 3% fewer seconds per token (TRIAL_MARGIN). Taking turns is what makes ~100 tokens a fair test
  on a machine whose speed drifts over seconds: one block of each, one after the other, times the
  same step differently from one block to the next, enough to drop a plan that is faster than AR
  steps. A pick that a pair of turns measures TRIAL_GIVE_UP times slower than AR steps has lost
  already.
- DRAFT runs the kept plan; its iterations inform the candidates inside it too.
- AUDIT: after AUDIT_EVERY tokens of a kept plan (doubling after each audit it passes) AR steps and the
  plan take turns again, each audit judging on its own, since acceptance changes over a long
  generation (SmolLM2 continuing Pride and Prejudice accepts 1.5 tokens per iteration over the first
  400 tokens, which the model partly knows, and ~1.15 later). Below AUDIT_CLEAR the audits stop until
  the next probe. A passed audit asks the cost model again on the samples every candidate shares
  (probes, and shadow drafts on the AR turns of trials and audits); a plan it expects to be
  1 / TRIAL_MARGIN times faster is tried, and if it loses, the audited plan runs on (SmolLM2 on a CPU:
  the probe after the prompt estimated `1,1` above `3`, which commits 1.61 tokens an iteration against
  1.49 over 1,024 tokens).
- AR runs plain AR steps as `--method ar` does (`plain_ar_steps`: the loop reports them as one run)
  until the next probe: RETUNE_AFTER_AR tokens, doubling for each probe in a row that ends here.

Exploring has a budget (`Budget`): what the tuner's own work costs (shadow drafts, the choice's
timing passes, recording) and what drafting iterations lose to AR steps' speed is spent from
EXPLORATION_BUDGET of the generation's projected time plus what drafting iterations saved. A probe
starts, and goes on past its first step, only if its expected cost fits; the AR turns draft shadow
tries only while they fit. So where drafting never pays, `--tree auto` runs within that share of
`--method ar`, however fast the step (where a step is so short that a shadow draft costs a large
part of it, a probe, its choice and a trial's first turns cost many steps, and short generations are
not probed at all).

`Tuner` is what the loop talks to: it drafts the shadow tries, records acceptance, runs the cost
model, and hands each iteration to the policy once (`observe`).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tokenswift_trt.decode.stages import DecodeState, candidates_from_hidden, chain_rows, retrieve_ngrams
from tokenswift_trt.decode.tree import StaticTree, TreeSpec, Trie, build_static_tree, build_trie
from tokenswift_trt.decode.tuner_costs import (
    IterationCosts,
    ProbeRecorder,
    accepted_path,
    choose_plan,
    measure_path_drafting,
    measure_ranking,
    measure_sampling,
    measure_verify,
    tree_text,
)
from tokenswift_trt.model.decoder import drafts_along_paths, reads_root
from tokenswift_trt.model.engine import Engine

# The probe's tree and n-gram k by device type and drafting source ("partial": a separate draft pass
# on the partial cache, whose first level is the base model's one draft; "verify": depth d uses draft
# layer d). On a GPU a verify of ~120 nodes costs about one step, so the largest tree and k are probed;
# on a CPU a verify costs about its node count and the plans that win are small (2, 3, 2,1, ...).
PROBES: dict[tuple[str, str], tuple[TreeSpec, int]] = {
    ("cuda", "partial"): (TreeSpec.parse("1,3,3,3"), 20),
    ("cuda", "verify"): (TreeSpec.parse("3,3,3"), 20),
    ("cpu", "partial"): (TreeSpec.parse("1,3,2,1"), 4),
    ("cpu", "verify"): (TreeSpec.parse("3,2,1"), 4),
}
# probe iterations with the probe tree: acceptance counts add up over probes and over the iterations of
# the plans that run; a probe is the tuner's overhead, and the trial catches a plan chosen on too few
PROBE_ITERATIONS = 16
SHADOW_PROBE_STEPS = 32  # a probe on AR steps (drafting from the verify pass): cheap, so twice as long
# Acceptance changes as a long generation goes on (text that starts to repeat makes n-gram branches
# pay; a kept plan only learns about the candidates inside it), so probes come again
RETUNE_EVERY = 2048  # probe again after this many new tokens of a kept drafting plan
RETUNE_AFTER_AR = 512  # ... or this many after settling on AR steps, doubling for each such probe in a row
TRIAL_ITERATIONS = 48  # the model's drafting plan, timed for real ...
AR_TRIAL_STEPS = 32  # ... against this many plain AR steps ...
TURNS = 4  # ... the two taking turns, this many of each (12 iterations, then 8 steps, ...)
# ... and kept only if it is this much faster per token: trials of ~50 tokens on a machine whose speed
# drifts by several percent cannot tell closer plans apart
TRIAL_MARGIN = 0.97
# ... and given up, lost, once a pair of turns measured it this much slower than AR steps (beyond what a
# drifting machine does between two turns): a losing pick costs one turn, not all of its iterations
TRIAL_GIVE_UP = 1.25
AUDIT_EVERY = 256  # tokens of a kept drafting plan before its first audit against AR steps (then doubling)
AUDIT_CLEAR = 0.85  # no more audits once the drafting plan's seconds per token is below this share of AR's
# A drafting iteration costs at least an AR step (its verify pass) plus the drafting, so a probe whose
# best candidate commits fewer tokens per iteration than this settles on AR steps without timing
# verify passes (~20 forwards of the tuner's own overhead)
MIN_TOKENS_PER_ITERATION = 1.05
# share of the generation's projected time the tuner may spend exploring: at 1% the default stays within
# 3% of `--method ar` where drafting does not pay (docs/benchmarks.md, cpu-auto-vs-ar-*)
EXPLORATION_BUDGET = 0.01
CHOOSE_COST_STEPS = 30  # the first choice's timing passes, in AR steps, until one is measured (~16-40)


def probe_plan(draft_source: str, device: torch.device) -> tuple[TreeSpec, int]:
    """(tree, n-gram k) the tuner probes with for this drafting source ("partial" / "verify") here."""
    return PROBES["cuda" if device.type == "cuda" else "cpu", draft_source]


@dataclass(frozen=True)
class Plan:
    """What the decode loop runs: a static tree and n-gram k, or plain AR steps (tree None)."""

    tree: TreeSpec | None  # a static tree (1,3,3,3), or None: plain AR steps
    ngram_topk: int
    from_token: int = 0  # new-token count when the plan started (Stats.plans)
    probe: bool = False  # the tuner's probe, run to measure acceptance
    trial: bool = False  # a turn of a trial: the model's pick or AR steps, timed against each other
    audit: bool = False  # a turn of an audit: AR steps or the kept drafting plan

    def __post_init__(self) -> None:
        if self.tree is not None and self.tree.auto:
            raise ValueError("a plan runs a static tree or AR steps, not the tuner's `auto`")

    @property
    def branching(self) -> tuple[int, ...]:
        """Candidates per depth; () for AR steps."""
        return () if self.tree is None else self.tree.branching

    def static_tree(self) -> StaticTree | None:
        return None if self.tree is None else build_static_tree(self.tree.branching)

    def __str__(self) -> str:
        if self.probe and self.tree is None:
            return f"probe on ar steps from token {self.from_token}"
        kind = "probe " if self.probe else "trial " if self.trial else "audit " if self.audit else ""
        return f"{kind}{tree_text(self.tree)} k={self.ngram_topk} from token {self.from_token}"


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
        drafting = next((turn for turn in plans[start:end] if turn.tree is not None), plan)
        kind = "trial" if plan.trial else "audit"
        described.append(
            f"{kind} {tree_text(drafting.tree)} k={drafting.ngram_topk} against ar steps, "
            f"{end - start} turns, from token {plan.from_token}"
        )
        start = end
    return described


# ---------------------------------------------------------------- the policy


class Phase(enum.Enum):
    PROBE = "probe"  # measuring acceptance (AR steps with shadow drafts, or the probe tree)
    TRIAL = "trial"  # the cost model's pick and AR steps taking turns
    DRAFT = "draft"  # a drafting plan kept
    AUDIT = "audit"  # the kept plan and AR steps taking turns again
    AR = "ar"  # plain AR steps


@dataclass(frozen=True)
class Report:
    """One iteration as the loop saw it (a run of plain AR steps counts as one)."""

    tokens: int  # committed
    seconds: float  # its own time, the tuner's work left out
    drafted: bool  # False: AR steps
    position: int  # new tokens after it
    left: int  # tokens the generation may still commit (to its limit)
    done: bool = False  # the generation ended with it


@dataclass
class Budget:
    """Seconds the tuner may spend exploring: `share` of the generation's projected time (its decode
    seconds so far plus the tokens left at AR steps' speed), plus what drafting iterations saved
    against AR steps' speed, less what the tuner's own work cost."""

    share: float = field(default_factory=lambda: EXPLORATION_BUDGET)
    elapsed_s: float = 0.0  # of the iterations reported
    ar_s_per_token: float | None = None  # AR steps' recent speed
    spent_s: float = 0.0  # the tuner's own work
    saved_s: float = 0.0  # drafting iterations against AR steps' speed (negative: lost)
    shadow_s: float = 0.0  # one shadow draft, on average
    choose_s: float | None = None  # the last choice

    def account(self, report: Report) -> None:
        self.elapsed_s += report.seconds
        if not report.drafted:
            per_token = report.seconds / max(1, report.tokens)
            previous = self.ar_s_per_token
            weight = min(1.0, report.tokens / 64)
            self.ar_s_per_token = (
                per_token if previous is None else previous + (per_token - previous) * weight
            )
        elif self.ar_s_per_token is not None:
            self.saved_s += report.tokens * self.ar_s_per_token - report.seconds

    def note_shadow(self, seconds: float) -> None:
        self.shadow_s = seconds if not self.shadow_s else self.shadow_s + (seconds - self.shadow_s) / 8

    def allowance(self, left: int) -> float:
        """Seconds left to spend, with `left` tokens still to come."""
        projected = self.elapsed_s + left * (self.ar_s_per_token or 0.0)
        return self.share * projected + self.saved_s - self.spent_s

    def probe_cost(self, shadows: int) -> float:
        """Expected seconds of `shadows` more shadow drafts, the choice after them and a trial's first
        pair of turns (its AR turn's shadow drafts, and a drafting turn that may run at half speed)."""
        step = self.ar_s_per_token or 0.0
        choose = self.choose_s if self.choose_s is not None else CHOOSE_COST_STEPS * step
        trial = AR_TRIAL_STEPS // TURNS * self.shadow_s + TRIAL_ITERATIONS // TURNS * step
        return shadows * self.shadow_s + choose + trial


@dataclass
class _Side:
    seconds: float = 0.0
    tokens: int = 0
    iterations: int = 0

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens


@dataclass
class _Turns:
    """A trial or an audit in progress: the drafting plan `plan` and AR steps taking turns, each
    side timed on its own."""

    plan: Plan  # the drafting plan tried or audited
    fallback: Plan  # what runs if a trial is lost: AR steps, or the plan a re-choice would replace
    drafting: _Side = field(default_factory=_Side)
    ar: _Side = field(default_factory=_Side)
    in_turn: int = 0  # iterations of the running turn

    def side(self, ar: bool) -> tuple[_Side, int]:
        """The timing of one side and the iterations it runs in all."""
        return (self.ar, AR_TRIAL_STEPS) if ar else (self.drafting, TRIAL_ITERATIONS)

    def side_done(self, ar: bool) -> bool:
        timing, total = self.side(ar)
        return timing.iterations >= total

    @property
    def ratio(self) -> float:
        """The drafting plan's seconds per token over AR steps'."""
        return self.drafting.seconds_per_token / self.ar.seconds_per_token


class Policy:
    """The phases of the module docstring's diagram: `next` takes each iteration's `Report` and says
    which plan runs next. `choose()` is the cost model's pick after a probe (AR steps included);
    `rechoose(plan)` a plan it expects to beat the audited `plan` by 1 / TRIAL_MARGIN, or None."""

    def __init__(
        self,
        probe: Plan,
        probe_length: int,
        choose: Callable[[], Plan],
        rechoose: Callable[[Plan], Plan | None],
        start: int = 1,
    ) -> None:
        self.probe, self.probe_length = probe, probe_length  # the probe's plan; samples it takes
        self.choose, self.rechoose = choose, rechoose
        self.budget = Budget()
        self.history: list[Plan] = []
        self.phase = Phase.PROBE
        self._turns: _Turns | None = None  # TRIAL, AUDIT
        self._reports = 0  # in this phase
        self._next_probe = 0  # new-token position of the next probe (AR, DRAFT)
        self._next_audit = 0  # ... and of the next audit (DRAFT)
        self._audits = 0  # audits the kept plan passed
        self._ar_streak = 0  # probes in a row that ended in AR steps
        self._enter_probe(start)

    @property
    def plan(self) -> Plan:
        return self.history[-1]

    @property
    def probes_on_ar_steps(self) -> bool:
        return self.probe.tree is None

    def plain_ar_steps(self, position: int) -> int:
        """AR steps the loop may run as `--method ar` does and report as one run: those to the next
        probe in the AR phase, else 0 (each iteration reported)."""
        return max(1, self._next_probe - position) if self.phase is Phase.AR else 0

    def shadow_wanted(self, left: int) -> bool:
        """Whether the tuner drafts the probe trie after this AR step: on a probe's steps, and on the
        AR turns of trials and audits while the budget allows (samples that score every candidate)."""
        if not self.probes_on_ar_steps or self.plan.tree is not None:
            return False
        if self.phase is Phase.PROBE:
            return True
        return self._turns is not None and self.budget.shadow_s <= self.budget.allowance(left)

    def next(self, report: Report, probe_samples: int = 0) -> Plan:
        """The plan after `report`'s iteration; `probe_samples`: the probe's recorded samples so far."""
        self.budget.account(report)
        self._reports += 1
        if self.phase is Phase.PROBE:
            self._probing(report, probe_samples)
        elif self.phase in (Phase.TRIAL, Phase.AUDIT):
            self._turn(report)
        if self.phase in (Phase.AR, Phase.DRAFT) and not report.done:
            self._settled(report)
        return self.plan

    # transitions, one method each

    def _enter(self, phase: Phase, plan: Plan) -> None:
        self.phase, self._reports = phase, 0
        self.history.append(plan)

    def _enter_probe(self, position: int) -> None:
        self._turns = None
        self._enter(Phase.PROBE, Plan(self.probe.tree, self.probe.ngram_topk, max(1, position), probe=True))

    def _enter_ar(self, position: int) -> None:
        self._ar_streak += 1
        self._enter(Phase.AR, Plan(None, 0, position))
        self._schedule_probe(position)

    def _enter_draft(self, plan: Plan, position: int, audits: int = 0, schedule: bool = True) -> None:
        """A kept plan; `schedule`: a probe and audit clock that starts now (else: audited again)."""
        self._audits = audits
        self._enter(Phase.DRAFT, Plan(plan.tree, plan.ngram_topk, position))
        if schedule:
            self._ar_streak = 0
            self._schedule_probe(position)
            self._next_audit = position + AUDIT_EVERY

    def _enter_turns(self, turns: _Turns, audit: bool, position: int) -> None:
        """A trial (the pick runs first) or an audit (AR steps first: the plan was running)."""
        self._turns = turns
        self.phase = Phase.AUDIT if audit else Phase.TRIAL
        self._turn_to(ar=audit, position=position)

    def _turn_to(self, ar: bool, position: int) -> None:
        turns, audit = self._turns, self.phase is Phase.AUDIT
        assert turns is not None
        turns.in_turn = 0
        tree, topk = (None, 0) if ar else (turns.plan.tree, turns.plan.ngram_topk)
        self.history.append(Plan(tree, topk, position, trial=not audit, audit=audit))

    def _schedule_probe(self, position: int) -> None:
        ar = self.phase is Phase.AR
        self._next_probe = position + (RETUNE_AFTER_AR * 2 ** (self._ar_streak - 1) if ar else RETUNE_EVERY)

    # each phase's handling of a report

    def _probing(self, report: Report, samples: int) -> None:
        """PROBE -> AR (over budget at its first step, or the choice is AR steps) | TRIAL (a pick)."""
        budget = self.budget
        if (
            self.probes_on_ar_steps
            and self._reports == 1
            and budget.probe_cost(self.probe_length - 1) > budget.allowance(report.left)
        ):
            self._enter_ar(report.position)
            return
        if samples < self.probe_length or report.done:
            return
        started = time.perf_counter()
        pick = self.choose()
        budget.choose_s = time.perf_counter() - started
        if pick.tree is None:
            self._enter_ar(report.position)
        else:
            self._enter_turns(_Turns(pick, Plan(None, 0)), audit=False, position=report.position)

    def _turn(self, report: Report) -> None:
        """An iteration of a trial or audit, timed to its side; the sides take turns of 1/TURNS of
        their iterations; once both have run all of theirs, or an AR turn ends with the drafting
        plan TRIAL_GIVE_UP times slower, the trial or audit ends."""
        turns = self._turns
        assert turns is not None
        ar = not report.drafted
        timing, total = turns.side(ar)
        timing.seconds, timing.tokens = timing.seconds + report.seconds, timing.tokens + report.tokens
        timing.iterations += 1
        turns.in_turn += 1
        turn_over = not turns.side_done(not ar) and (
            turns.in_turn >= -(-total // TURNS) or turns.side_done(ar)
        )
        given_up = turn_over and ar and turns.drafting.tokens > 0 and turns.ratio >= TRIAL_GIVE_UP
        if (turns.side_done(ar) and turns.side_done(not ar)) or given_up:
            self._turns = None
            if self.phase is Phase.AUDIT:
                self._end_audit(turns, report.position)
            else:
                self._end_trial(turns, report.position)
        elif turn_over:
            self._turn_to(ar=not ar, position=report.position)

    def _end_trial(self, turns: _Turns, position: int) -> None:
        """TRIAL -> DRAFT (clearly faster than AR steps) | the fallback: AR, or DRAFT of the plan a
        re-choice tried to replace."""
        if turns.ratio < TRIAL_MARGIN:
            self._enter_draft(turns.plan, position)
        elif turns.fallback.tree is None:
            self._enter_ar(position)
        else:
            self._enter_draft(turns.fallback, position)

    def _end_audit(self, turns: _Turns, position: int) -> None:
        """AUDIT -> AR (no longer faster by the trial's margin: judged on this audit alone, since a
        plan that paid early on is not carried by its past) | TRIAL (passed; the shared samples favour
        another plan, the audited one the fallback) | DRAFT (passed)."""
        if turns.ratio >= TRIAL_MARGIN:
            self._enter_ar(position)
            return
        better = self.rechoose(turns.plan)
        if better is not None:
            self._enter_turns(_Turns(better, turns.plan), audit=False, position=position)
            return
        self._enter_draft(turns.plan, position, self._audits + 1, schedule=False)
        clear = turns.ratio < AUDIT_CLEAR
        self._next_audit = self._next_probe if clear else position + AUDIT_EVERY * 2**self._audits

    def _settled(self, report: Report) -> None:
        """AR | DRAFT -> PROBE (due, and within budget; else rescheduled) | AUDIT (DRAFT, due)."""
        if report.position >= self._next_probe:
            if self.budget.probe_cost(self.probe_length) <= self.budget.allowance(report.left):
                self._enter_probe(report.position)
            else:
                self._schedule_probe(report.position)
        elif self.phase is Phase.DRAFT and report.position >= self._next_audit:
            self._enter_turns(_Turns(self.plan, Plan(None, 0)), audit=True, position=report.position)


# ---------------------------------------------------------------- the tuner


class Tuner:
    """`--tree auto` as the decode loop sees it: `plan` before an iteration, `observe` after it (once
    per iteration; a run of plain AR steps is one, `plain_ar_steps` says how long). It drafts the
    probe's shadow tries, records acceptance, runs the cost model when the policy asks, and hands
    every iteration to the `Policy`."""

    def __init__(
        self, engine: Engine, state: DecodeState, from_verify: bool, max_trie: int, clock: Callable[[], int]
    ) -> None:
        self.engine, self.state, self.from_verify, self.max_trie = engine, state, from_verify, max_trie
        self.clock = clock  # new tokens so far (plans are logged by it)
        self.probe_tree, self.probe_topk = probe_plan("verify" if from_verify else "partial", engine.device)
        self._probe_static = build_static_tree(self.probe_tree.branching)
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
        self._probe_costs = IterationCosts(0.0, 0.0, 0.0, 0)
        self._probe_iterations = 0
        self._last_hidden: torch.Tensor | None = None
        probe = Plan(None, 0) if from_verify else Plan(self.probe_tree, self.probe_topk)
        length = SHADOW_PROBE_STEPS if from_verify else PROBE_ITERATIONS
        self.policy = Policy(probe, length, self._choose, self._rechoose, clock())
        self.history = self.policy.history

    @property
    def plan(self) -> Plan:
        return self.policy.plan

    def plain_ar_steps(self) -> int:
        """AR steps the loop may run as `--method ar` does before it reports them (as one iteration):
        while the tuner has settled on AR steps, those up to its next probe; else 0 (report each)."""
        return self.policy.plain_ar_steps(self.clock())

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
        `seconds` and committed `tokens`; returns the plan to run next. What this costs is spent
        from the exploration budget."""
        started = time.perf_counter()
        plan, left = self.plan, self.state.limit - len(self.state.tokens)
        if self.policy.shadow_wanted(left):
            self._shadow_draft(last_hidden, probe=plan.probe)
        if plan.probe and plan.tree is not None:  # a probe tree runs every iteration
            assert trie is not None and costs is not None
            self._record_probe(trie, accepted_nodes, costs)
        elif not plan.probe:
            self._settle_shadows()
            if trie is not None and not done:  # the running plan's iterations count too
                self.recorder.record(trie, accepted_nodes, (plan.branching, plan.ngram_topk))
        self._last_hidden = last_hidden
        report = Report(tokens, seconds, trie is not None, self.clock(), left, done)
        after = self.policy.next(report, self._probe_iterations)
        if after is not plan and after.probe:
            self._probe_costs, self._probe_iterations = IterationCosts(0.0, 0.0, 0.0, 0), 0
            self._shadows.clear()
        self.policy.budget.spent_s += time.perf_counter() - started
        return after

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
        end = time.perf_counter()
        costs = IterationCosts(drafted - tick, end - drafted, 0.0, len(trie))
        self.policy.budget.note_shadow(end - tick)
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

    def _choose(self) -> Plan:
        """The cost model's pick after a probe, priced with costs timed here and now."""
        engine, state, count, hidden = self.engine, self.state, self._probe_iterations, self._last_hidden
        assert hidden is not None
        recorder = self.recorder
        if max(1 + recorder.mean_accepted(key) for key in recorder.accepted) < MIN_TOKENS_PER_ITERATION:
            return Plan(None, 0)
        totals = self._probe_costs
        self._costs = dict(
            verify_costs=measure_verify(engine, state, self.max_trie),
            draft_s=totals.draft_s / count,
            overhead_s=totals.commit_s / count,
            # drafting from the verify pass the head pass carries draft rows (one level: the trees CPUs pick)
            sampling_costs=measure_sampling(engine, state, hidden, 1 if self.from_verify else 0),
            device=engine.device,
            chain_rows=chain_rows(state),  # how larger tries sample
            per_node_s=totals.trie_s / totals.nodes,  # building a trie (n-grams included)
            # root-conditioned layers read each node's sample: their head pass is not batched
            batched_draft_s=(
                measure_ranking(engine, state, hidden)
                if self.from_verify and not reads_root(engine.draft_layers)
                else None
            ),
            draft_s_by_depth=(
                measure_path_drafting(engine, state, hidden, self._probe_static)
                if self.from_verify and drafts_along_paths(engine.draft_layers)
                else None
            ),
        )
        self._shared_at_choice = self.shared.iterations
        best, _ = choose_plan(self.recorder, **self._costs)
        return Plan(best.tree, best.ngram_topk)

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
            best.tree is None
            or current is None
            or (best.tree, best.ngram_topk) == (current.tree, current.ngram_topk)
        ):
            return None
        if best.tokens_per_s * TRIAL_MARGIN < current.tokens_per_s:
            return None
        return Plan(best.tree, best.ngram_topk)
