"""Serving metrics in the names operators already graph (vLLM's, with a `tokenswift:` prefix).

Triton serves them on its metrics port beside its own `nv_*` metrics. The model reports through a
`RequestMeter` per request: prompt tokens when the request starts, generated tokens as they stream
(so a cancelled request's tokens are counted), the speculative-decoding counters and the latency
histograms when it ends, and one outcome per request.

Terms: a *draft* is one iteration that offered draft tokens; *draft tokens* are the tokens it offered
along the trie's deepest path (one per depth); *accepted tokens* are the draft tokens the target kept;
`accepted_tokens_per_pos` counts, for each draft depth (position 0 = the first draft token after the
root), the iterations that accepted a token there. The batch gauges (`num_requests_running`,
`num_requests_waiting`) are set after every step of the instance's scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenswift_trt.decode.stats import Stats

PREFIX = "tokenswift:"
OUTCOMES = ("ok", "error", "cancelled")
# seconds; the same bucket edges vLLM uses for these histograms, trimmed at both ends
TTFT_BUCKETS = [0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0]
TPOT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0]
MAX_DRAFT_POSITIONS = 16  # per-position counters exist for draft depths below this

# name (after the prefix) -> (kind, description)
FAMILIES: dict[str, tuple[str, str]] = {
    "prompt_tokens_total": ("counter", "Prompt tokens of requests started"),
    "generation_tokens_total": ("counter", "Tokens generated, counted as they stream (cancelled included)"),
    "spec_decode_num_drafts_total": ("counter", "Decode iterations that offered draft tokens"),
    "spec_decode_num_draft_tokens_total": ("counter", "Draft tokens offered (one per trie depth)"),
    "spec_decode_num_accepted_tokens_total": ("counter", "Draft tokens accepted by verification"),
    "spec_decode_num_accepted_tokens_per_pos_total": (
        "counter",
        "Iterations that accepted the draft token at this depth (position 0 = first draft token)",
    ),
    "request_success_total": ("counter", "Requests by outcome (ok, error, cancelled)"),
    "request_failure_total": (
        "counter",
        "Failed requests by reason (invalid_request, server_busy, server_shutdown, out_of_memory, ...)",
    ),
    "time_to_first_token_seconds": ("histogram", "Seconds from a request's arrival to its first token"),
    "time_per_output_token_seconds": ("histogram", "Seconds per generated token after the first"),
    "e2e_request_latency_seconds": ("histogram", "Seconds from a request's arrival to its end"),
    "num_requests_running": ("gauge", "Requests in the instance's batch (decoded together)"),
    "num_requests_waiting": ("gauge", "Requests waiting for room in the batch or for cache memory"),
    "num_requests_waiting_for_memory": ("gauge", "Waiting requests whose caches do not fit yet"),
    "batch_plan_ar_steps": (
        "gauge",
        "1 while the batch's planner holds its --tree auto requests to AR steps (faster here), else 0",
    ),
}
BUCKETS = {
    "time_to_first_token_seconds": TTFT_BUCKETS,
    "time_per_output_token_seconds": TPOT_BUCKETS,
    "e2e_request_latency_seconds": E2E_BUCKETS,
}


class ServingMetrics:
    """The metric families and their series, made through Triton's `pb_utils.MetricFamily`.

    `family_type` is `pb_utils.MetricFamily` (passed in so that this module imports without Triton).
    """

    def __init__(self, family_type: Any, model: str = "tokenswift") -> None:
        kinds = {
            "counter": family_type.COUNTER,
            "gauge": family_type.GAUGE,
            "histogram": family_type.HISTOGRAM,
        }
        # the families must outlive their series, so both are kept
        self.families = {
            name: family_type(name=PREFIX + name, description=description, kind=kinds[kind])
            for name, (kind, description) in FAMILIES.items()
        }
        labels = {"model": model}
        self.series: dict[str, Any] = {}
        for name, (kind, _) in FAMILIES.items():
            if name in (
                "spec_decode_num_accepted_tokens_per_pos_total",
                "request_success_total",
                "request_failure_total",
            ):
                continue
            if kind == "histogram":
                self.series[name] = self.families[name].Metric(labels=labels, buckets=BUCKETS[name])
            else:
                self.series[name] = self.families[name].Metric(labels=labels)
        self.per_position = [
            self.families["spec_decode_num_accepted_tokens_per_pos_total"].Metric(
                labels={**labels, "position": str(position)}
            )
            for position in range(MAX_DRAFT_POSITIONS)
        ]
        self.outcomes = {
            outcome: self.families["request_success_total"].Metric(labels={**labels, "outcome": outcome})
            for outcome in OUTCOMES
        }

        self.labels = labels
        self.failures: dict[str, Any] = {}  # reason -> series, made when a reason first occurs

    def failure(self, reason: str) -> None:
        if reason not in self.failures:
            self.failures[reason] = self.families["request_failure_total"].Metric(
                labels={**self.labels, "reason": reason}
            )
        self.failures[reason].increment(1)

    def batch(self, running: int, waiting: int, waiting_for_memory: int, ar_steps: bool = False) -> None:
        """The batch as the scheduler left it after a step (`ar_steps`: its planner's choice)."""
        self.series["num_requests_running"].set(running)
        self.series["num_requests_waiting"].set(waiting)
        self.series["num_requests_waiting_for_memory"].set(waiting_for_memory)
        self.series["batch_plan_ar_steps"].set(int(ar_steps))

    def meter(self) -> RequestMeter:
        """A meter for one request, started now."""
        return RequestMeter(self)


@dataclass
class RequestMeter:
    """One request's reports; the clock starts when it is made (the request's arrival)."""

    metrics: ServingMetrics
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0)
    first_token_at: float | None = None
    tokens: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        self.start = self.clock()

    def prompt(self, count: int) -> None:
        self.metrics.series["prompt_tokens_total"].increment(count)

    def generated(self, count: int) -> None:
        if count <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = self.clock()
            self.metrics.series["time_to_first_token_seconds"].observe(self.first_token_at - self.start)
        self.tokens += count
        self.metrics.series["generation_tokens_total"].increment(count)

    def drafts(self, stats: Stats) -> None:
        """The speculative-decoding counters of a finished generation."""
        drafts = sum(stats.reached_by_depth[:1])  # iterations that offered a first draft token
        if drafts:
            self.metrics.series["spec_decode_num_drafts_total"].increment(drafts)
        if stats.drafted_tokens:
            self.metrics.series["spec_decode_num_draft_tokens_total"].increment(stats.drafted_tokens)
        if stats.accepted_tokens:
            self.metrics.series["spec_decode_num_accepted_tokens_total"].increment(stats.accepted_tokens)
        for position, accepted in enumerate(stats.accepted_by_depth[:MAX_DRAFT_POSITIONS]):
            if accepted:
                self.metrics.per_position[position].increment(accepted)

    def end(self, outcome: str, reason: str = "") -> None:
        """Record the outcome (with the failure's `reason`, errors.py) and latencies once (later calls
        do nothing)."""
        if self.finished:
            return
        self.finished = True
        now = self.clock()
        self.metrics.outcomes[outcome].increment(1)
        if reason:
            self.metrics.failure(reason)
        self.metrics.series["e2e_request_latency_seconds"].observe(now - self.start)
        if self.first_token_at is not None and self.tokens > 1:
            per_token = (now - self.first_token_at) / (self.tokens - 1)
            self.metrics.series["time_per_output_token_seconds"].observe(per_token)
