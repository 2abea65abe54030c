"""Continuous batching: many requests decoded together by one model instance.

A `Scheduler` keeps up to `max_batch` requests active. Each step it resumes every active request's
steps (`loop.request_steps`: the same loop code a request runs alone) until each asks for its next
forward (`stages.ForwardCall`), runs all those forwards as one batched pass
(`decoder.forward_batch`: every product over all requests' rows at once, attention per request on
its own cache and tree mask), and hands each request its rows. Acceptance and commit stay per
request. Requests join between steps and leave when they finish, are cancelled or fail; none waits
for another to finish. A joining request's prompt runs in the steps too, one prefill chunk
(`prefill_chunk` tokens) a step beside the others' iterations, so that a long prompt does not stop
the requests generating meanwhile.

Memory: the requests' caches come out of one budget (`memory_budget` bytes, default the memory free
when the scheduler starts). A request is admitted when its caches fit what the active ones leave; one
that does not fit waits in the queue (`Request.waiting_reason` says why) and is admitted when enough
is released. A request's caches are released when it ends however it ends.

The plan per batch: each `--tree auto` request's tuner chooses its plan from its own iterations'
timings, but in a batch a drafting iteration's cost falls on every request (the batched pass grows by
its tree) while its gain is its own. `BatchPlanner` therefore times the batch as a whole: with two or
more requests active, windows of steps where those requests run their tuners' plans take turns with
windows where they are held to plain AR steps, and the faster way, in tokens per second over the
whole batch, is kept for a while before the next trial (a change of batch size starts one at once).
So a batch runs no slower than batched AR steps, within the trial's cost; the choice is in
`Scheduler.planner.hold`, and each request counts its held steps (`Stats.held_steps`).

Tensor parallel (`lockstep`): every rank of a tensor-parallel instance runs a scheduler over its
slices of the model, and their batched forwards must be the same calls in the same order. Rank 0's
scheduler leads: before each step it sends the workers' schedulers (`Lockstep.exchange`) the
requests submitted and cancelled since the step before and its planner's choice, with a digest of
the tokens it committed in that step; a follower applies them, checks the digest against its own
and steps. Admission, acceptance and commits are functions of those inputs, so the ranks stay in
step; a rank whose tokens differ stops the group (`LockstepError`).

Still the model's own output: a request's tokens are those of its run alone, whatever else is in
the batch and whenever it joined. Its rows in a batched forward are the same bits as in its own
(the CPU products and every per-row step are batch-invariant; attention sees its own cache only),
and sampling is keyed by (seed, position).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from tokenswift_trt.decode.admission import available_bytes
from tokenswift_trt.decode.config import GenerationConfig, GenerationError, MemoryAdmissionError
from tokenswift_trt.decode.loop import RequestSteps, request_steps
from tokenswift_trt.decode.stages import ForwardCall
from tokenswift_trt.decode.stats import Stats
from tokenswift_trt.decode.threads import ThreadGovernor
from tokenswift_trt.model.decoder import Segment, forward_batch
from tokenswift_trt.model.engine import Engine

QUEUED, RUNNING, FINISHED, CANCELLED, FAILED = "queued", "running", "finished", "cancelled", "failed"


@dataclass
class Request:
    """One request in the scheduler: what was asked, where it stands, and what it produced."""

    id: int
    prompt: list[int]
    config: GenerationConfig
    on_tokens: Callable[[list[int]], None] | None = None
    cancelled: Callable[[], bool] | None = None  # polled before every step: True cancels the request
    status: str = QUEUED
    tokens: list[int] = field(default_factory=list)  # committed so far (streamed through on_tokens too)
    stats: Stats | None = None  # live while running, final once finished
    error: str = ""  # why it failed
    failure: BaseException | None = None  # what it failed with (an exception its own steps raised)
    waiting_reason: str = ""  # why it is still queued (memory), "" when admitted
    reserved_bytes: int = 0  # its caches' share of the memory budget while it runs
    _steps: RequestSteps | None = None
    _call: ForwardCall | None = None  # the forward it waits for

    @property
    def done(self) -> bool:
        return self.status in (FINISHED, CANCELLED, FAILED)


@dataclass
class BatchStats:
    """What the scheduler did: the batch size of each step's forward, and the tokens committed."""

    batch_sizes: list[int] = field(default_factory=list)  # requests in each step's forward
    tokens: int = 0  # committed over all requests

    @property
    def mean_batch(self) -> float:
        return sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 0.0


TRIAL, KEEP = "trial", "keep"


@dataclass
class StepJob:
    """What a leading scheduler did before a step, for its followers to do the same."""

    submitted: list[tuple[int, list[int], GenerationConfig]]  # (id, prompt, config) in order
    cancelled: list[int]  # ids
    hold: bool  # the planner's choice for this step
    digest: int  # of the tokens committed in the step before


class Lockstep(Protocol):
    """How the schedulers of a tensor-parallel instance's ranks stay in step: the leader sends its
    `StepJob` (and gets it back), a follower sends None and gets the leader's."""

    leader: bool

    def exchange(self, job: StepJob | None) -> StepJob: ...


class LockstepError(RuntimeError):
    """A follower committed other tokens than the leader (their logits differ)."""


def token_digest(digest: int, ids: Sequence[int]) -> int:
    """`digest` extended by `ids` (a running hash of the tokens a step commits, in order)."""
    for token in ids:
        digest = (digest * 1_000_003 + token + 1) % (1 << 61)
    return digest


@dataclass
class BatchPlanner:
    """Whether a batch's `--tree auto` requests run their own plans (`hold` False) or plain AR steps
    (`hold` True): turns of `window_steps` steps each way, `turns` of each, then the faster kept for
    `keep_steps` steps (doubling while the same way keeps winning, up to `max_keep_steps`); the plans
    must beat AR steps by `margin` to be kept. A trial whose first turns already differ by `decisive`
    ends there (the slower way is not run for the rest of it). A batch size decided before starts
    with that decision kept for `keep_steps` rather than with a trial (requests joining and leaving
    change the size often)."""

    window_steps: int = 8
    turns: int = 3
    keep_steps: int = 128
    max_keep_steps: int = 2048
    margin: float = 1.03
    decisive: float = 1.25
    hold: bool = False
    phase: str = TRIAL
    batch: int = 0  # the batch size the current trial or choice is for
    _steps: int = 0  # steps in the current window (trial) or kept (keep)
    _seconds: dict[bool, float] = field(default_factory=lambda: {False: 0.0, True: 0.0})
    _tokens: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    _windows: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    _keep_for: int = 0
    _last_choice: bool | None = None
    _decided: dict[int, bool] = field(default_factory=dict)  # the last decision per batch size
    choices: list[tuple[int, bool]] = field(default_factory=list)  # (batch size, hold) per decision

    def observe(self, batch: int, eligible: bool, seconds: float, tokens: int) -> None:
        """One step of `batch` requests (`eligible`: two or more, one of them a `--tree auto` request
        drafting) that took `seconds` and committed `tokens` over all of them."""
        if not eligible:
            self.hold, self.phase, self.batch = False, TRIAL, 0
            return
        if batch != self.batch:  # another batch size: its decision if it has one, else a trial
            if batch in self._decided:
                self._keep(batch, self._decided[batch], self.keep_steps)
            else:
                self._start_trial(batch)
            return
        self._steps += 1
        if self.phase == KEEP:
            if self._steps >= self._keep_for:
                self._start_trial(batch)
            return
        self._seconds[self.hold] += seconds
        self._tokens[self.hold] += tokens
        if self._steps < self.window_steps:
            return
        self._windows[self.hold] += 1
        self._steps = 0
        rate = {side: self._tokens[side] / max(self._seconds[side], 1e-9) for side in (False, True)}
        both = min(self._windows.values()) >= 1 and self._windows[False] == self._windows[True]
        clear = both and max(rate[False], rate[True]) >= self.decisive * min(rate[False], rate[True])
        if min(self._windows.values()) < self.turns and not clear:
            self.hold = not self.hold
            return
        choice = not rate[False] > rate[True] * self.margin
        keep = (
            min(self._keep_for * 2, self.max_keep_steps) if choice == self._last_choice else self.keep_steps
        )
        self._keep(batch, choice, keep)
        self.choices.append((batch, choice))

    def _keep(self, batch: int, choice: bool, steps: int) -> None:
        """Run `choice` (hold: AR steps) for `steps` steps of this batch size."""
        self.batch, self.hold, self.phase, self._steps = batch, choice, KEEP, 0
        self._keep_for, self._last_choice, self._decided[batch] = steps, choice, choice

    def _start_trial(self, batch: int) -> None:
        self.batch, self.phase, self.hold, self._steps = batch, TRIAL, False, 0
        for side in (False, True):
            self._seconds[side], self._tokens[side], self._windows[side] = 0.0, 0, 0


class Scheduler:
    """Decodes many requests at once on one engine (see the module doc).

    `max_batch`: requests active at once. `memory_budget`: bytes all requests' caches may take
    together (None: what is free now). Drive it with `step()` (one batched iteration) or `run()`
    (until every request has ended); `submit` and `cancel` between steps."""

    def __init__(
        self,
        engine: Engine,
        max_batch: int = 8,
        memory_budget: int | None = None,
        planner: BatchPlanner | None = None,
        lockstep: Lockstep | None = None,
    ) -> None:
        """`lockstep`: this is one rank's scheduler of a tensor-parallel instance (see the module doc);
        a follower takes its requests from the leader, not from `submit`."""
        if max_batch < 1:
            raise GenerationError(f"the batch must hold at least 1 request, got --max-batch {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self.memory_budget = memory_budget if memory_budget is not None else available_bytes(engine.device)
        self.queue: deque[Request] = deque()
        self.active: list[Request] = []
        self._ended: list[Request] = []  # ended since the last `take_ended`
        self.stats = BatchStats()
        self._ids = itertools.count()
        self.governor = (
            ThreadGovernor.for_setting(engine.kernels.threads) if engine.device.type == "cpu" else None
        )
        self.planner = planner or BatchPlanner()
        self.lockstep = lockstep
        self._unsent: list[tuple[int, list[int], GenerationConfig]] = []  # leader: submitted since a step
        self._cancelled: list[int] = []  # leader: ids cancelled since a step
        self._digest = 0  # the tokens committed in the current step

    @property
    def reserved_bytes(self) -> int:
        return sum(request.reserved_bytes for request in self.active)

    @property
    def pending(self) -> bool:
        return bool(self.queue or self.active)

    def submit(
        self,
        prompt: Sequence[int],
        config: GenerationConfig,
        on_tokens: Callable[[list[int]], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Request:
        """Queue a request; it joins the batch at the next step with room for it. Its settings are
        checked now (GenerationError naming the bad value). `on_tokens` gets its tokens as they commit;
        `cancelled`, polled before every step, ends it when it returns True."""
        config.validate()
        if config.device_loop:
            raise GenerationError("batched requests run the host loop: drop --device-loop")
        config = replace(config, device_loop=False)
        request = Request(next(self._ids), list(prompt), config, on_tokens, cancelled)
        self.queue.append(request)
        if self.lockstep is not None:
            self._unsent.append((request.id, request.prompt, config))
        return request

    def cancel(self, request: Request) -> None:
        """End a request now; its caches are released, the others go on."""
        if request.done:
            return
        if request in self.queue:
            self.queue.remove(request)
        if self.lockstep is not None and self.lockstep.leader:
            self._cancelled.append(request.id)
        self._end(request, CANCELLED)

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while self.pending:
            self.step()

    def step(self) -> None:
        """Admit what fits, then one iteration of every active request with their forwards batched."""
        tick, committed = time.perf_counter(), self.stats.tokens
        if self.governor is not None:
            self.governor.apply()
        for request in [*self.queue, *self.active]:
            if request.cancelled is not None and request.cancelled():
                self.cancel(request)
        if self.lockstep is not None:
            self._exchange(self.lockstep)
        self._admit()
        forwarded, before = time.perf_counter(), self.stats.tokens  # the batch's step, without prefills
        waiting = [request for request in self.active if request._call is not None]
        if waiting:
            self._forward(waiting)
            for request in waiting:
                if request._call is not None and request._call.out is not None:
                    self._advance(request)
        if self.governor is not None and waiting:  # the thread count follows the batch's own speed
            self.governor.observe(time.perf_counter() - tick, max(1, self.stats.tokens - committed))
        if waiting and not (self.lockstep is not None and not self.lockstep.leader):  # a follower's is sent
            tuned = any(r.config.method == "tokenswift" and r.config.tree.auto for r in waiting)
            seconds, tokens = time.perf_counter() - forwarded, self.stats.tokens - before
            self.planner.observe(len(waiting), len(waiting) >= 2 and tuned, seconds, tokens)

    def lead_new_group(self, lockstep: Lockstep) -> None:
        """Lead a new group of followers (the old one failed; they start with nothing): what the old
        ones were told of is forgotten, what was submitted since is sent at the next step."""
        self.lockstep, self._digest, self._cancelled = lockstep, 0, []

    def _exchange(self, lockstep: Lockstep) -> None:
        """Send this step's job (leader) or take and apply the leader's (follower)."""
        if lockstep.leader:
            job = StepJob(self._unsent, self._cancelled, self.planner.hold, self._digest)
            self._unsent, self._cancelled = [], []
            lockstep.exchange(job)
        else:
            job = lockstep.exchange(None)
            if job.digest != self._digest:
                raise LockstepError("tensor-parallel ranks committed different tokens (their logits differ)")
            for identifier, prompt, config in job.submitted:
                request = Request(identifier, list(prompt), config)
                self.queue.append(request)
            for identifier in job.cancelled:
                for request in [*self.queue, *self.active]:
                    if request.id == identifier:
                        self.cancel(request)
            self.planner.hold = job.hold
        self._digest = 0

    def fail_all(self, message: str, failure: BaseException | None = None) -> None:
        """End every queued and active request as failed (the scheduler itself cannot go on), with
        `failure` as what each failed with."""
        for request in [*self.queue, *self.active]:
            if request in self.queue:
                self.queue.remove(request)
            request.failure = request.failure or failure
            self._end(request, FAILED, message)

    def take_ended(self) -> list[Request]:
        """The requests that ended (finished, cancelled or failed) since the last call."""
        ended, self._ended = self._ended, []
        return ended

    # ------------------------------------------------------------ internals

    def _admit(self) -> None:
        """Start queued requests while the batch and the memory budget have room: each runs its prefill
        and stops at its first forward."""
        while self.queue and len(self.active) < self.max_batch:
            request = self.queue[0]
            left = self.memory_budget - self.reserved_bytes
            config = replace(request.config, memory_budget=max(1, left))

            def tokens(new: list[int], request: Request = request) -> None:
                request.tokens.extend(new)
                self.stats.tokens += len(new)
                if self.lockstep is not None:
                    self._digest = token_digest(token_digest(self._digest, [request.id]), new)
                if request.on_tokens is not None:
                    request.on_tokens(new)

            request._steps = request_steps(
                self.engine, request.prompt, config, tokens, hold=lambda: self.planner.hold
            )
            self.queue.popleft()
            request.status = RUNNING
            self.active.append(request)
            try:
                self._advance(request)
            except MemoryAdmissionError as error:
                self.active.remove(request)
                request._steps, request.status = None, QUEUED
                if not self.active:  # nothing running will release memory: it can never fit
                    request.failure = error
                    self._end(request, FAILED, str(error))
                    continue
                request.waiting_reason = f"memory: {error}"
                self.queue.appendleft(request)
                return
            request.waiting_reason = ""

    def _advance(self, request: Request) -> None:
        """Resume a request until it asks for a forward (kept in `_call`) or ends."""
        assert request._steps is not None
        request._call = None
        try:
            while True:
                item = request._steps.send(None)
                if isinstance(item, ForwardCall):
                    if request.reserved_bytes == 0:
                        request.reserved_bytes = item.state.needed_bytes
                    request._call = item
                    return
                request.stats = item
        except StopIteration as finished:
            _, request.stats = finished.value
            self._end(request, FINISHED)
        except MemoryAdmissionError:
            if request.reserved_bytes == 0:
                raise  # not admitted yet: the caller queues it again
            self._end(request, FAILED, "out of memory")
        except Exception as error:  # noqa: BLE001 (a request's failure never ends the others)
            request.failure = error
            self._end(request, FAILED, str(error).splitlines()[0] if str(error) else type(error).__name__)

    def _forward(self, requests: list[Request]) -> None:
        """Every waiting forward in one batched pass; a pass that fails is retried one request at a
        time, so that only the request at fault fails."""
        alone = [r for r in requests if r._call is not None and r._call.state.static_full is not None]
        for request in alone:  # fixed-shape (CUDA-graph) steps run as captured, one request each
            assert request._call is not None
            with torch.inference_mode():
                request._call.run_alone(self.engine)
        requests = [request for request in requests if request not in alone]
        if not requests:
            return
        calls = [request._call for request in requests]
        segments = [
            Segment(
                call.tokens,
                call.positions,
                call.state.full,
                None if call.tree_mask is None else call.tree_mask.to(self.engine.device),
            )
            for call in calls  # type: ignore[union-attr]
        ]
        self.stats.batch_sizes.append(len(calls))
        try:
            with torch.inference_mode():
                outputs = forward_batch(self.engine.model, segments)
        except (RuntimeError, ValueError):
            if self.lockstep is not None:  # the ranks' collectives: retries alone would not be in step
                raise
            for request in requests:
                call = request._call
                assert call is not None
                try:
                    with torch.inference_mode():
                        call.run_alone(self.engine)
                except (RuntimeError, ValueError) as error:
                    self._end(request, FAILED, str(error).splitlines()[0])
            return
        for call, output in zip(calls, outputs, strict=True):
            call.out = output  # type: ignore[union-attr]
        self._ar_logits([call for call in calls if call is not None and call.wants_logits])

    def _ar_logits(self, calls: list[ForwardCall]) -> None:
        """The AR steps' target logits, one LM-head pass per sampling setting shared: on a small model
        the head is a large part of a step, and each request reading it alone would read it once per
        request. A row's logits are the bits of its own pass (the head's products are batch-invariant,
        and a penalty window padded with its own first id penalises the same tokens)."""
        groups: dict[object, list[ForwardCall]] = {}
        for call in calls:
            groups.setdefault(call.state.sampling, []).append(call)
        for sampling, group in groups.items():
            if len(group) < 2:
                continue
            hidden = torch.cat([call.out.hidden[-1:] for call in group])  # type: ignore[union-attr]
            windows = [call.state.window() for call in group]
            width = max(window.numel() for window in windows)  # all 0 without a penalty
            rows = torch.stack(  # [R, W]
                [torch.cat((window[:1].expand(width - window.numel()), window)) for window in windows]
            )
            with torch.inference_mode():
                logits = self.engine.model.target_logits(hidden, sampling, rows)
            for index, call in enumerate(group):
                call.logits = logits[index : index + 1]

    def _end(self, request: Request, status: str, error: str = "") -> None:
        """Close the request's steps (its adapter's work is awaited there) and release its caches."""
        steps, request._steps, request._call = request._steps, None, None
        if steps is not None and status != FINISHED:
            steps.close()
        request.status, request.error = status, error
        request.reserved_bytes = 0
        if request in self.active:
            self.active.remove(request)
        self._ended.append(request)
