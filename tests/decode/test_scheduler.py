"""Continuous batching: requests decoded together give the tokens of their runs alone, whatever else
is in the batch, whenever they join, and whoever is cancelled or fails; memory is admitted against one
budget and released."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import tokenswift_trt as ts
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.scheduler import CANCELLED, FAILED, FINISHED, QUEUED, Scheduler
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.cpu_decoder import CpuDecoder
from tokenswift_trt.model.decoder import Attention, LlamaModel, Segment, forward_batch
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig

from conftest import quiet_load

GREEDY = SamplingConfig(temperature=0)
PAPER = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=64)


@pytest.fixture(scope="module")
def tiny():
    """swift-tiny: a float32 CPU engine, so the compiled decoder batches the requests' rows."""
    return ts.load("swift-tiny")


def _prompts(model, count: int) -> list[list[int]]:
    texts = [
        "Once upon a time there was a little fox",
        "The river ran past the mill and down to the sea, where",
        "She opened the letter slowly.",
        "In the morning the king called his three sons and said",
        "It was the best of times, it was the worst of times",
        "The old man and the sea",
    ]
    return [model.codec.encode(texts[i % len(texts)]) for i in range(count)]


def _configs() -> list[GenerationConfig]:
    return [
        GenerationConfig(max_new_tokens=60, sampling=GREEDY, ignore_eos=True, method="ar"),
        GenerationConfig(max_new_tokens=70, sampling=PAPER, seed=3, ignore_eos=True, tree="3,3"),
        GenerationConfig(max_new_tokens=50, sampling=PAPER, seed=4, ignore_eos=True, method="ar"),
        GenerationConfig(
            max_new_tokens=80, sampling=GREEDY, ignore_eos=True, tree="1,3,3", draft_source="verify"
        ),
        GenerationConfig(max_new_tokens=65, sampling=PAPER, seed=9, ignore_eos=True),  # tree auto
        GenerationConfig(
            max_new_tokens=40, sampling=PAPER, seed=5, ignore_eos=True, tree="2,2", ngram_topk=4
        ),
    ]


def _alone(engine, prompt, config) -> list[int]:
    return generate(engine, prompt, config)[0]


def test_batched_requests_commit_their_own_runs_tokens(tiny):
    engine = tiny.engine
    prompts, configs = _prompts(tiny, 6), _configs()
    scheduler = Scheduler(engine, max_batch=4)
    streamed: dict[int, list[int]] = {}
    requests = []
    for index in range(4):
        requests.append(
            scheduler.submit(prompts[index], configs[index], streamed.setdefault(index, []).extend)
        )
    for _ in range(7):  # the first four mid-generation, then two more join
        scheduler.step()
    assert all(request.status != QUEUED for request in requests)
    for index in (4, 5):
        requests.append(
            scheduler.submit(prompts[index], configs[index], streamed.setdefault(index, []).extend)
        )
    scheduler.run()
    for index, request in enumerate(requests):
        assert request.status == FINISHED, request.error
        alone = _alone(engine, prompts[index], configs[index])
        assert request.tokens == alone == streamed[index], index
    assert max(scheduler.stats.batch_sizes) == 4  # the forwards were batched
    assert scheduler.reserved_bytes == 0 and not scheduler.active


def test_a_long_prompt_joins_chunk_by_chunk_while_the_others_go_on(tiny):
    """A request whose prompt takes several prefill chunks joins mid-generation: each step runs one of
    its chunks beside the others' iterations (they keep committing), and its tokens are its run's alone."""
    engine = tiny.engine
    prompts, configs = _prompts(tiny, 2), _configs()
    long_prompt = (sum(_prompts(tiny, 6), []) * 4)[:150]  # 5 chunks of 32
    assert len(long_prompt) == 150
    joining = replace(configs[1], prefill_chunk=32, max_new_tokens=20)
    scheduler = Scheduler(engine, max_batch=4)
    running = [scheduler.submit(prompts[i], configs[i]) for i in range(2)]
    for _ in range(3):
        scheduler.step()
    late = scheduler.submit(long_prompt, joining)
    before = [len(r.tokens) for r in running]
    steps = 0
    while not late.tokens:
        scheduler.step()
        steps += 1
    assert steps == 5  # one chunk a step, the first token after the last
    assert all(len(r.tokens) >= b + 4 for r, b in zip(running, before))  # they went on meanwhile
    scheduler.run()
    assert late.status == FINISHED and late.tokens == _alone(engine, long_prompt, joining)
    for request, prompt, config in zip(running, prompts, configs):
        assert request.tokens == _alone(engine, prompt, config)


def test_cancelled_and_failing_requests_leave_the_others_tokens_unchanged(tiny):
    engine = tiny.engine
    prompts, configs = _prompts(tiny, 4), _configs()

    def failing(tokens: list[int], seen: list[int] = []) -> None:  # noqa: B006 (the request's own list)
        seen.extend(tokens)
        if len(seen) > 20:
            raise RuntimeError("the client went away")

    scheduler = Scheduler(engine, max_batch=4)
    kept = scheduler.submit(prompts[0], configs[1])
    cancelled = scheduler.submit(prompts[1], configs[3])
    failed = scheduler.submit(prompts[2], configs[0], failing)
    other = scheduler.submit(prompts[3], configs[4])
    for _ in range(5):
        scheduler.step()
    scheduler.cancel(cancelled)
    scheduler.run()
    assert cancelled.status == CANCELLED and failed.status == FAILED
    assert "client went away" in failed.error
    assert kept.status == other.status == FINISHED
    assert kept.tokens == _alone(engine, prompts[0], configs[1])
    assert other.tokens == _alone(engine, prompts[3], configs[4])
    assert scheduler.reserved_bytes == 0


def test_a_request_that_does_not_fit_waits_for_memory(tiny):
    engine = tiny.engine
    prompts, configs = _prompts(tiny, 2), _configs()
    probe = Scheduler(engine, max_batch=1)
    probe.submit(prompts[0], configs[0])
    probe.step()
    one = probe.active[0].reserved_bytes
    assert one > 0
    scheduler = Scheduler(engine, max_batch=4, memory_budget=int(one * 1.5))  # room for one at a time
    first = scheduler.submit(prompts[0], configs[0])
    second = scheduler.submit(prompts[1], configs[2])
    scheduler.step()
    assert first.status == "running" and second.status == QUEUED
    assert second.waiting_reason.startswith("memory")
    scheduler.run()
    assert first.status == second.status == FINISHED
    assert second.tokens == _alone(engine, prompts[1], configs[2])
    assert max(scheduler.stats.batch_sizes) == 1 and scheduler.reserved_bytes == 0


def test_a_request_that_can_never_fit_fails_with_the_reason(tiny):
    scheduler = Scheduler(tiny.engine, max_batch=2, memory_budget=1024)
    request = scheduler.submit(_prompts(tiny, 1)[0], _configs()[0])
    scheduler.run()
    assert request.status == FAILED and "memory" in request.error.lower()


def test_forward_batch_rows_are_the_bits_of_each_forward_alone(llama_dir):
    """Two requests at different cache lengths, one verifying a tree, one an AR step: the compiled
    decoder's batched call gives each the bits of its own forward."""
    engine = quiet_load(llama_dir[0], dtype=torch.float32)
    model = engine.model
    if model.cpu_decoder is None:
        pytest.skip("the compiled CPU decoder does not build on this machine")
    config = engine.config
    generator = torch.Generator().manual_seed(0)

    prefixes = {
        length: torch.randint(0, config.vocab_size, (length,), generator=generator) for length in (17, 40)
    }

    def cache_with(length: int) -> KVCache:
        cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 256, torch.float32, "cpu")
        model(prefixes[length], torch.arange(length), cache)
        cache.commit()
        return cache

    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    first = (torch.tensor([5, 9, 11, 3]), torch.tensor([17, 18, 18, 19]), tree)
    second = (torch.tensor([7]), torch.tensor([40]), None)
    alone = []
    for (tokens, positions, mask), length in ((first, 17), (second, 40)):
        cache = cache_with(length)
        alone.append(model(tokens, positions, cache, tree_mask=mask, keep_queries=True))
    caches = [cache_with(17), cache_with(40)]
    calls = []
    original = CpuDecoder.run_batch

    def counted(self, *args, **kwargs):
        calls.append(len(args[3]))
        return original(self, *args, **kwargs)

    CpuDecoder.run_batch = counted
    try:
        together = forward_batch(
            model, [Segment(*first[:2], caches[0], first[2]), Segment(*second[:2], caches[1], second[2])]
        )
    finally:
        CpuDecoder.run_batch = original
    assert calls == [2]  # one call of the compiled decoder for both
    for one, both in zip(alone, together, strict=True):
        assert torch.equal(one.hidden, both.hidden)
        assert all(torch.equal(a, b) for a, b in zip(one.queries, both.queries, strict=True))
    assert caches[0].pending == 4 and caches[1].pending == 1


def test_batched_forward_runs_the_products_once_for_all_segments(llama_dir):
    """The layers' pass over several segments (`batched_forward`, the CUDA default): each layer's
    products run once over every row, attention per segment on its own cache, and each segment gets its
    own forward's outputs (float64: equal to rounding) and K/V."""
    engine = quiet_load(llama_dir[0], dtype=torch.float64, kernels=KernelConfig(batched_forward="on"))
    model, config = engine.model, engine.config
    assert model.batched_forward
    generator = torch.Generator().manual_seed(1)
    prefixes = {n: torch.randint(0, config.vocab_size, (n,), generator=generator) for n in (9, 23, 40)}

    def cache_with(length: int) -> KVCache:
        cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 128, torch.float64, "cpu")
        model(prefixes[length], torch.arange(length), cache)
        cache.commit()
        return cache

    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    steps = [  # a tree verify, an AR step, a causal chunk
        (torch.tensor([5, 9, 11]), torch.tensor([9, 10, 10]), tree, 9),
        (torch.tensor([7]), torch.tensor([23]), None, 23),
        (torch.tensor([3, 1, 4, 1]), torch.arange(40, 44), None, 40),
    ]
    alone, caches = [], []
    for tokens, positions, mask, length in steps:
        cache = cache_with(length)
        alone.append((model(tokens, positions, cache, tree_mask=mask, keep_queries=True), cache))
        caches.append(cache_with(length))
    passes = []
    original = Attention.forward_segments

    def counted(self, *args, **kwargs):
        passes.append(len(args[3]))  # the segments' row counts
        return original(self, *args, **kwargs)

    Attention.forward_segments = counted
    try:
        together = forward_batch(
            model, [Segment(t, p, cache, m) for (t, p, m, _), cache in zip(steps, caches, strict=True)]
        )
    finally:
        Attention.forward_segments = original
    assert passes == [3] * config.num_layers  # one pass per layer over the three segments
    for (one, own_cache), both, cache in zip(alone, together, caches, strict=True):
        torch.testing.assert_close(both.hidden, one.hidden, rtol=0, atol=1e-12)
        for a, b in zip(one.queries, both.queries, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
        assert cache.pending == own_cache.pending
        end = cache.length + cache.pending
        torch.testing.assert_close(cache.keys[:, :, :end], own_cache.keys[:, :, :end], rtol=0, atol=1e-12)
        torch.testing.assert_close(cache.values[:, :, :end], own_cache.values[:, :, :end], rtol=0, atol=1e-12)


def test_batched_forward_requests_commit_their_own_runs_tokens(llama_dir):
    """Requests on an engine whose batch runs as one pass of the layers (no compiled decoder: float64)
    commit the tokens of their runs alone, greedy and seeded, trees and AR steps mixed."""
    engine = quiet_load(llama_dir[0], dtype=torch.float64, kernels=KernelConfig(batched_forward="on"))
    generator = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(0, engine.config.vocab_size, (n,), generator=generator).tolist() for n in (7, 12, 5)
    ]
    configs = [
        GenerationConfig(max_new_tokens=30, sampling=GREEDY, ignore_eos=True, method="ar"),
        GenerationConfig(max_new_tokens=36, sampling=PAPER, seed=3, ignore_eos=True, tree="2,2"),
        GenerationConfig(max_new_tokens=24, sampling=GREEDY, ignore_eos=True, tree="1,3"),
    ]
    scheduler = Scheduler(engine, max_batch=3)
    requests = [scheduler.submit(p, c) for p, c in zip(prompts, configs, strict=True)]
    passes = []
    original = LlamaModel._batched_decode

    def counted(self, segments):
        passes.append(len(segments))
        return original(self, segments)

    LlamaModel._batched_decode = counted
    try:
        scheduler.run()
    finally:
        LlamaModel._batched_decode = original
    assert max(passes) == 3
    for request, prompt, config in zip(requests, prompts, configs, strict=True):
        assert request.status == FINISHED, request.error
        assert request.tokens == _alone(engine, prompt, config)


def test_submit_refuses_what_cannot_run(tiny):
    scheduler = Scheduler(tiny.engine)
    with pytest.raises(ts.GenerationError if hasattr(ts, "GenerationError") else ValueError):
        scheduler.submit([1, 2], replace(_configs()[0], max_new_tokens=0))
    with pytest.raises(ValueError, match="at least 1 request"):
        Scheduler(tiny.engine, max_batch=0)


@pytest.mark.parametrize("sampling", [GREEDY, PAPER], ids=["greedy", "paper"])
def test_ar_steps_sharing_their_settings_share_one_head_pass_and_keep_their_tokens(tiny, sampling):
    """AR steps of requests with one sampling setting take their logits from one LM-head pass; their
    penalty windows differ in length (prompts shorter than the window) and are padded, which must not
    change a token."""
    engine = tiny.engine
    prompts = _prompts(tiny, 4)
    configs = [
        GenerationConfig(
            max_new_tokens=48 + 8 * i, sampling=sampling, seed=20 + i, ignore_eos=True, method="ar"
        )
        for i in range(4)
    ]
    passes = []
    original = type(engine.model).target_logits

    def counted(self, hidden, *args, **kwargs):
        passes.append(hidden.shape[0])
        return original(self, hidden, *args, **kwargs)

    scheduler = Scheduler(engine, max_batch=4)
    requests = [scheduler.submit(p, c) for p, c in zip(prompts, configs, strict=True)]
    type(engine.model).target_logits = counted
    try:
        scheduler.run()
    finally:
        type(engine.model).target_logits = original
    assert max(passes) == 4  # one pass for the four requests' rows
    for request, prompt, config in zip(requests, prompts, configs, strict=True):
        assert request.tokens == _alone(engine, prompt, config)


@pytest.mark.parametrize("window", [1, 3])
def test_tree_auto_requests_held_to_ar_steps_by_the_planner_keep_their_tokens(tiny, window):
    """The batch's planner switching `--tree auto` requests between their own plans and AR steps every
    `window` steps changes none of their tokens (lossless either way), and each counts its held steps."""
    from tokenswift_trt.decode.scheduler import BatchPlanner

    engine = tiny.engine
    prompts = _prompts(tiny, 3)
    configs = [
        GenerationConfig(max_new_tokens=90, sampling=PAPER, seed=9, ignore_eos=True),  # tree auto
        GenerationConfig(max_new_tokens=80, sampling=GREEDY, ignore_eos=True),  # tree auto
        GenerationConfig(max_new_tokens=70, sampling=PAPER, seed=4, ignore_eos=True, tree="2,2"),
    ]
    planner = BatchPlanner(window_steps=10**9)  # decides nothing itself: the test switches it
    scheduler = Scheduler(engine, max_batch=3, planner=planner)
    requests = [scheduler.submit(p, c) for p, c in zip(prompts, configs, strict=True)]
    planner.batch, planner.hold = 3, True  # held from the first iteration
    steps = 0
    while scheduler.pending:
        scheduler.step()
        steps += 1
        if steps % window == 0:
            planner.hold = not planner.hold
    for request, prompt, config in zip(requests, prompts, configs, strict=True):
        assert request.status == FINISHED, request.error
        assert request.tokens == _alone(engine, prompt, config)
    assert requests[0].stats.held_steps > 0 and requests[1].stats.held_steps > 0
    assert requests[2].stats.held_steps == 0  # a fixed tree is never held


def test_a_batch_of_tree_auto_requests_is_planned_and_keeps_its_tokens(tiny):
    """Left to itself, the planner times a batch of `--tree auto` requests both ways and decides;
    whatever it decides, every request writes its own run's tokens."""
    from tokenswift_trt.decode.scheduler import BatchPlanner

    engine = tiny.engine
    prompts = _prompts(tiny, 2)
    configs = [
        GenerationConfig(max_new_tokens=48, sampling=PAPER, seed=2, ignore_eos=True),
        GenerationConfig(max_new_tokens=48, sampling=GREEDY, ignore_eos=True),
    ]
    planner = BatchPlanner(window_steps=2, turns=2, keep_steps=4)
    scheduler = Scheduler(engine, max_batch=2, planner=planner)
    requests = [scheduler.submit(p, c) for p, c in zip(prompts, configs, strict=True)]
    scheduler.run()
    assert planner.choices and all(batch == 2 for batch, _ in planner.choices)
    for request, prompt, config in zip(requests, prompts, configs, strict=True):
        assert request.tokens == _alone(engine, prompt, config)


def test_the_planner_keeps_the_faster_way_and_tries_again_for_another_batch_size():
    from tokenswift_trt.decode.scheduler import KEEP, TRIAL, BatchPlanner

    planner = BatchPlanner(window_steps=2, turns=2, keep_steps=4)
    planner.observe(4, True, 0.1, 4)  # a new batch size: a trial starts, own plans first
    assert planner.phase == TRIAL and not planner.hold

    def steps(count: int, own_rate: float, ar_rate: float) -> None:
        for _ in range(count):
            rate = ar_rate if planner.hold else own_rate
            planner.observe(4, True, 0.1, int(rate * 0.1))

    steps(8, own_rate=90, ar_rate=100)  # two windows of two steps each way: AR steps are faster
    assert planner.phase == KEEP and planner.hold and planner.choices == [(4, True)]
    steps(4, own_rate=90, ar_rate=100)  # kept for keep_steps, then tried again
    assert planner.phase == TRIAL and not planner.hold
    steps(8, own_rate=110, ar_rate=100)  # now the plans win by more than the margin
    assert planner.phase == KEEP and not planner.hold and planner.choices[-1] == (4, False)
    planner.observe(2, True, 0.1, 10)  # a request left: a trial for the new size
    assert planner.phase == TRIAL and planner.batch == 2
    planner.observe(4, True, 0.1, 10)  # back to a size decided before: its decision, kept
    assert planner.phase == KEEP and not planner.hold and planner.batch == 4
    planner.observe(1, False, 0.1, 10)  # one request alone: its own tuner decides, nothing held
    assert not planner.hold


def test_a_clear_difference_ends_the_trial_after_one_turn_each_way():
    from tokenswift_trt.decode.scheduler import KEEP, BatchPlanner

    planner = BatchPlanner(window_steps=2, turns=3, keep_steps=4)
    planner.observe(8, True, 0.1, 4)  # the trial starts

    def steps(count: int, own_rate: float, ar_rate: float) -> None:
        for _ in range(count):
            rate = ar_rate if planner.hold else own_rate
            planner.observe(8, True, 0.1, int(rate * 0.1))

    steps(4, own_rate=60, ar_rate=100)  # one window each way, AR steps 1.67x faster: decided now
    assert planner.phase == KEEP and planner.hold and planner.choices == [(8, True)]


class _Pair:
    """An in-process `Lockstep` pair: the leader's job is what the follower's next exchange returns."""

    def __init__(self) -> None:
        self.jobs: list = []

    def side(self, leader: bool):
        pair = self

        class Side:
            def __init__(self) -> None:
                self.leader = leader

            def exchange(self, job):
                if leader:
                    pair.jobs.append(job)
                    return job
                return pair.jobs.pop(0)

        return Side()


def test_a_follower_in_lockstep_runs_the_leaders_requests_cancels_and_plan_to_the_same_tokens(tiny):
    from tokenswift_trt.decode.scheduler import BatchPlanner, LockstepError

    engine = tiny.engine
    pair = _Pair()
    leader = Scheduler(
        engine, max_batch=2, planner=BatchPlanner(window_steps=10**9), lockstep=pair.side(True)
    )
    follower = Scheduler(engine, max_batch=2, lockstep=pair.side(False))
    prompts, configs = _prompts(tiny, 3), _configs()
    chosen = [configs[1], configs[0], configs[5]]
    led = [leader.submit(prompts[0], chosen[0])]

    def step_both() -> None:
        leader.step()
        follower.step()

    for _ in range(3):
        step_both()
    led += [leader.submit(p, c) for p, c in zip(prompts[1:], chosen[1:])]  # one queues: batch of 2
    leader.planner.hold = True  # the leader's plan for the next step is the followers' too
    step_both()
    assert follower.planner.hold
    leader.planner.hold = False
    step_both()
    leader.cancel(led[1])
    while leader.pending:
        step_both()
    step_both()  # the follower hears of the last step's tokens (and checks them) at the next exchange
    followed = {request.id: request for request in [*follower.active, *follower.take_ended()]}
    for request in led:
        assert followed[request.id].status == request.status
        assert followed[request.id].tokens == request.tokens
    assert led[1].status == CANCELLED and led[0].status == led[2].status == FINISHED
    assert led[0].tokens == _alone(engine, prompts[0], chosen[0])

    # a follower whose tokens differ from the leader's stops at the next exchange
    pair = _Pair()
    leader = Scheduler(engine, max_batch=2, lockstep=pair.side(True))
    follower = Scheduler(engine, max_batch=2, lockstep=pair.side(False))
    leader.submit(prompts[0], chosen[1])
    step_both()
    step_both()
    follower._digest ^= 1  # as if it had committed another token
    leader.step()
    with pytest.raises(LockstepError, match="different tokens"):
        follower.step()


def test_a_leader_whose_followers_failed_leads_new_ones_from_a_clean_state(tiny):
    """After a failed step (a worker died mid-step, its tokens half committed) the leader leads a
    fresh follower: what the old group was told is forgotten, requests submitted since reach it."""
    engine = tiny.engine
    prompts, configs = _prompts(tiny, 2), _configs()
    old = _Pair()
    leader = Scheduler(engine, max_batch=2, lockstep=old.side(True))
    leader.submit(prompts[0], configs[1])
    leader.step()
    leader.step()  # tokens committed since the last exchange: the old followers' digest to check
    leader.fail_all("a tensor-parallel rank stopped")
    later = leader.submit(prompts[1], configs[0])
    new = _Pair()
    leader.lead_new_group(new.side(True))
    follower = Scheduler(engine, max_batch=2, lockstep=new.side(False))
    while leader.pending:
        leader.step()
        follower.step()
    leader.step()
    follower.step()  # the last step's digest, checked
    (followed,) = [*follower.active, *follower.take_ended()]
    assert followed.id == later.id and followed.tokens == later.tokens
    assert later.status == FINISHED and later.tokens == _alone(engine, prompts[1], configs[0])
