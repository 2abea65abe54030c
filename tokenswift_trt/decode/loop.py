"""The decoding loops: one request's iterations, TokenSwift's (host or device executor) and the AR
baseline's.

The host loop strings together the named stages of stages.py (propose -> build trie -> verify ->
accept -> commit) and, with tree="auto", asks the tuner (autotune.py) which plan to run; the
terms (root, draft, accepted and bonus tokens) are defined in stages.py. The request's settings are
in config.py, its statistics in stats.py, the construction of its state in state.py.
"""

from __future__ import annotations

import random as random_module
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace

import torch

from tokenswift_trt.decode.autotune import IterationCosts, Plan, Tuner, probe_plan
from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.device_loop import DeviceLoop, run_device_loop
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
from tokenswift_trt.decode.state import new_adapter, new_decode_state, refresh_drafting_state
from tokenswift_trt.decode.stats import WINDOW_TOKENS, Stats, count_drafts
from tokenswift_trt.decode.suffix import LOOKUP_EVERY, MatchGate
from tokenswift_trt.decode.threads import ThreadGovernor
from tokenswift_trt.decode.tree import Trie, build_trie
from tokenswift_trt.model.decoder import ForwardOutput
from tokenswift_trt.model.draft_adaptation import DraftAdapter
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import PositionKeyedRandom, RandomSource

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
    `config.tree.auto` (tree "auto") tunes the tree and n-gram k while generating (decode/autotune.py).
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
    hold: Callable[[], bool] | None = None,
) -> RequestSteps:
    """One request's generation as a driver runs it: the prompt's prefill at the first resume, then
    the iterations; yields a `ForwardCall` wherever an iteration needs a forward on the full cache
    (the driver sets its output before resuming: `run_alone` at once, the scheduler batched with
    other requests') and the live Stats after every iteration; returns (new ids, Stats). `hold`,
    asked before each iteration of a `--tree auto` request, True runs a plain AR step instead of the
    tuner's plan (a batch's planner: scheduler.py); the tuner does not hear of those steps."""
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
        hidden = yield from prefill(engine, state, prompt, config.prefill_chunk)
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
                refresh_drafting_state(state)  # the partial cache's first selection, the prompt's n-grams
                yield from _tokenswift_loop(
                    engine, state, config, stats, started, hidden, on_tokens, acceptor, adapter, hold
                )
    finally:  # also when the caller stops early: no step may still run on memory about to go
        if adapter is not None:
            adapter.finish()
    return _finish(state, config, stats, started)


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
    count_drafts(stats, trie, acceptance, 1, position)
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
    hold: Callable[[], bool] | None = None,
) -> Generator[Stats | ForwardCall, None, None]:
    """Iterations of propose -> build trie -> verify -> accept -> commit, under a fixed plan or the
    tuner's; `adapter` adapts the draft layers (`engine.draft_layers`, its copy) from every commit;
    `hold` True: a plain AR step instead of the tuner's plan (`request_steps`)."""
    from_verify = config.resolved_draft_source == "verify"
    new_tokens = lambda: len(state.tokens) - state.prompt_length  # noqa: E731
    tuner = (
        Tuner(engine, state, from_verify, state.full.capacity - state.limit, new_tokens)
        if config.tree.auto
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
        held = tuner is not None and hold is not None and hold()
        if not held and tuner is not None and (steps := tuner.plain_ar_steps()):
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
        elif tree is None or held:  # a plain AR step, the same code as the AR baseline's
            stats.held_steps += held
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
                refresh_drafting_state(state)
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
            count_drafts(stats, trie, acceptance, 1 if from_verify else 2, position)
        iteration_s = time.perf_counter() - tick
        stats.iterations += 1
        stats.new_tokens, stats.elapsed_s = new_tokens(), time.perf_counter() - started
        if on_tokens:
            on_tokens(acceptance.tokens)
        yield stats
        done = acceptance.tokens[-1] in state.stop_tokens or len(state.tokens) >= state.limit
        if tuner is not None and not held:
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
    auto = config.tree.auto
    tuner = Tuner(engine, state, True, state.full.capacity - state.limit, new_tokens) if auto else None
    plan = tuner.plan if tuner is not None else Plan(config.tree, config.ngram_topk)
    if auto:
        probe_tree, topk = probe_plan("verify", engine.device)
        largest = probe_tree.branching
    else:
        largest, topk = config.tree.branching, config.ngram_topk
    try:
        depth = min(len(largest), len(engine.draft_layers))  # the tuner's plans are no deeper
        loop = DeviceLoop(engine, state, depth, topk, capture, config.compile_steps, adapter)
    except ValueError as error:
        raise GenerationError(str(error)) from None
    if tuner is not None:
        stats.plans = tuner.history
    done = False
    while not done:
        if plan.tree is None:  # the tuner's AR steps
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
