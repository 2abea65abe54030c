"""A request's statistics: counts, phase times and acceptance (α, β, α by depth) in total and per
window of output positions (`Stats`, `Window`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenswift_trt.decode.autotune import Plan
from tokenswift_trt.decode.stages import Acceptance
from tokenswift_trt.decode.tree import Trie

WINDOW_TOKENS = 256  # output positions per window of `Stats.windows`


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
    held_steps: int = 0  # AR steps a batch's planner held this `--tree auto` request to (scheduler.py)

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


def count_drafts(stats: Stats, trie: Trie, acceptance: Acceptance, forwards: int, position: int) -> None:
    """One verified trie in `stats`: `forwards` decode forwards, its drafts and what the walk accepted
    of them, in the iteration's window (its first committed token at output `position`)."""
    stats.forwards += forwards  # verify (+ the draft pass)
    offered = max(trie.depths)  # the longest draft offered (n-gram branches may pass the tree)
    ngram_accepted = sum(1 for node in acceptance.nodes if not trie.from_tree[node])
    stats.count_drafting(position, len(acceptance.tokens), offered, len(acceptance.nodes), ngram_accepted)
