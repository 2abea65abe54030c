"""`--tree auto`: exact per-candidate acceptance from a probe trie, cost model, and a lossless run."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tokenswift_trt.decode.autotune import probe_plan
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.tree import TreeSpec, build_static_tree, build_trie
from tokenswift_trt.decode.tuner_costs import (
    CANDIDATE_TREES,
    ProbeRecorder,
    choose_plan,
    interpolate,
)
from tokenswift_trt.model.sampling import SamplingConfig


def _tree(text: str) -> TreeSpec:
    return TreeSpec.parse(text)


def _probe_trie():
    tree = build_static_tree("1,3,3,3")
    heads = [[10], [20, 21, 22], [30, 31, 32], [40, 41, 42]]
    ngrams = [(10, 50, 51, 52), (10, 20, 60, 61)]  # ranks 0 and 1 among grams starting with 10
    return build_trie(5, tree, heads, ngrams)


def _path(trie, tokens):
    node, nodes = 0, []
    for token in tokens:
        node = trie.children[node][token]
        nodes.append(node)
    return nodes


def _drive(engine, seconds_per_token: Callable[[TreeSpec | None, int], float], tokens: int):
    """A tuner drafting from the verify pass, driven for `tokens` new tokens (the cost model stubbed
    by the caller); AR steps take 1 s a token, a drafting plan `seconds_per_token(tree, new
    tokens so far)` (2 tokens an iteration). Returns the tuner."""
    from tokenswift_trt.decode.autotune import Tuner
    from tokenswift_trt.decode.state import new_decode_state
    from tokenswift_trt.decode.tuner_costs import IterationCosts
    from tokenswift_trt.model.sampling import PositionKeyedRandom

    hidden = torch.zeros(engine.config.hidden_size, dtype=engine.dtype)
    small = build_trie(5, build_static_tree("1,1"), [[10], [20]])
    costs = IterationCosts(0.0, 0.0, 0.0, len(small))
    state = new_decode_state(engine, [5, 6, 7], GenerationConfig(max_new_tokens=9000), PositionKeyedRandom(0))
    tuner = Tuner(engine, state, True, 64, lambda: len(state.tokens) - 3)
    while len(state.tokens) - 3 < tokens:
        if tuner.plan.tree is None:
            state.append([len(state.tokens) % 50])
            tuner.observe(None, [], None, hidden, False, 1.0, 1)
        else:
            state.append([len(state.tokens) % 50] * 2)
            seconds = 2 * seconds_per_token(tuner.plan.tree, len(state.tokens) - 3)
            tuner.observe(small, [], costs, hidden, False, seconds, 2)
    return tuner


def _stub_costs(monkeypatch):
    """Every measured cost 1 s (ranking free), no acceptance floor and the whole generation's time to
    explore in (steps of 1 s against a choice costed at CHOOSE_COST_STEPS steps): the stubbed cost
    model decides."""
    from tokenswift_trt.decode import autotune

    monkeypatch.setattr(autotune, "EXPLORATION_BUDGET", 1.0)

    monkeypatch.setattr(autotune, "measure_verify", lambda *args: {1: 1.0})
    monkeypatch.setattr(autotune, "measure_sampling", lambda *args: {1: 1.0})
    monkeypatch.setattr(autotune, "measure_ranking", lambda *args: 0.0)
    monkeypatch.setattr(autotune, "MIN_TOKENS_PER_ITERATION", 0.0)


def test_candidate_acceptance_follows_from_the_probe_path():
    trie = _probe_trie()
    recorder = ProbeRecorder(max_depth=4)
    recorder.record(trie, _path(trie, [10, 21, 30, 41]))  # ranks 0,1,0,1 in the static tree
    assert recorder.accepted[(_tree("1,1,1,1"), 0)] == 1  # rank 1 at depth 2 is missing
    assert recorder.accepted[(_tree("1,2,1,1"), 0)] == 3  # rank 1 at depth 4 is missing
    assert recorder.accepted[(_tree("1,2,2,2"), 0)] == 4
    assert recorder.accepted[(_tree("1"), 0)] == 1

    second = ProbeRecorder(max_depth=4)
    second.record(trie, _path(trie, [10, 20, 60, 61]))  # along n-gram rank 1 after the tree's 10 -> 20
    assert second.accepted[(_tree("1,1,1,1"), 0)] == 2
    assert second.accepted[(_tree("1,1,1,1"), 1)] == 2  # k=1 has only the rank-0 gram
    assert second.accepted[(_tree("1,1,1,1"), 2)] == 4


def test_a_running_plans_iterations_inform_only_the_candidates_inside_it():
    recorder = ProbeRecorder(max_depth=4)
    trie = _probe_trie()
    recorder.record(trie, _path(trie, [10, 21, 30, 41]))  # a probe iteration: every candidate
    small = build_trie(
        5, build_static_tree("1,2,1,1"), [[10], [20, 21], [30], [40]]
    )  # the plan 1,2,1,1 k=0 running
    for _ in range(3):
        recorder.record(small, _path(small, [10, 21, 30, 40]), ((1, 2, 1, 1), 0))
    assert recorder.iterations == 1  # probe iterations only
    assert (
        recorder.counts[(_tree("1,2,1,1"), 0)] == 4
        and recorder.mean_accepted((_tree("1,2,1,1"), 0)) == (3 + 3 * 4) / 4
    )
    assert (
        recorder.counts[(_tree("1,1"), 0)] == 4 and recorder.mean_accepted((_tree("1,1"), 0)) == 1.0
    )  # rank 1 at depth 2: no
    assert recorder.mean_nodes()[(_tree("1,2,1,1"), 0)] == 1 + 1 + 2 + 2 + 2
    for outside in (
        (_tree("1,3,3,3"), 0),
        (_tree("1,2,1,1"), 1),
        (_tree("1,2,2,1"), 0),
    ):  # a wider tree, n-grams
        assert recorder.counts[outside] == 1  # the probe's iteration alone


def test_candidate_trie_sizes_count_only_available_nodes():
    trie = _probe_trie()
    recorder = ProbeRecorder(max_depth=4)
    recorder.record(trie, [])
    sizes = recorder.mean_nodes()
    assert sizes[(_tree("1,3,3,3"), 0)] == 1 + 40
    assert sizes[(_tree("1,1,1,1"), 0)] == 1 + 4
    # gram 0 adds 50,51,52 below 10; gram 1 adds 60,61 below 10 -> 20 (20 is shared)
    assert sizes[(_tree("1,1,1,1"), 1)] == 1 + 4 + 3
    assert sizes[(_tree("1,1,1,1"), 2)] == 1 + 4 + 3 + 2
    assert sizes[(_tree("1,3,3,3"), 20)] == len(trie)


def test_a_long_matchs_branch_counts_for_every_plan_with_ngrams():
    """The loop offers a long match's branch with any k >= 1 (as rank 0): the probe scores its nodes,
    accepted and verified, for those plans and for no plan without n-grams."""
    trie = _probe_trie()
    trie.add_path([10, 20, 30, 40, 70, 71, 72, 73], from_tree=False, ngram_rank=0)  # along the tree, then on
    recorder = ProbeRecorder(max_depth=4)
    recorder.record(trie, _path(trie, [10, 20, 30, 40, 70, 71]))
    assert recorder.accepted[(_tree("1,1,1,1"), 0)] == 4  # the tree's own path
    assert recorder.accepted[(_tree("1,1,1,1"), 1)] == 6 and recorder.accepted[(_tree("1"), 1)] == 6
    sizes = recorder.mean_nodes()
    assert sizes[(_tree("1"), 1)] == 1 + 1 + 3 + 3 + 4  # root, the tree's 10, gram 0's 50-52, 20-30-40, 70-73
    assert sizes[(_tree("1"), 0)] == 1 + 1


def test_candidates_fit_inside_the_probe_tree():
    paper = ProbeRecorder(max_depth=4, probe_tree=_tree("1,3,3,3"))
    trees = {tree for tree, _, _ in paper.candidates}
    assert (
        _tree("1,3,3,3") in trees
        and _tree("1,1") in trees
        and _tree("3") not in trees
        and _tree("2,1") not in trees
    )
    verify = ProbeRecorder(max_depth=3, probe_tree=_tree("3,3,3"))
    trees = {tree for tree, _, _ in verify.candidates}
    assert (
        {_tree("1"), _tree("2"), _tree("3"), _tree("3,1"), _tree("3,2,1"), _tree("1,1,1")} <= trees
        and _tree("1,1,1,1") not in trees
        and _tree("1,3,3,3") not in trees
    )


def test_first_level_alternatives_are_scored_from_a_verify_probe():
    """Drafting from the verify pass, rank 2 of draft layer 1 accepted: trees 3 and 3,1 count it, 1 and 2 do
    not."""
    tree = build_static_tree("3,3,3")
    trie = build_trie(5, tree, [[20, 21, 22], [30, 31, 32], [40, 41, 42]], [], True)
    recorder = ProbeRecorder(max_depth=3, probe_tree=_tree("3,3,3"))
    recorder.record(trie, _path(trie, [22, 30]))
    assert recorder.accepted[(_tree("1"), 0)] == recorder.accepted[(_tree("2"), 0)] == 0
    assert recorder.accepted[(_tree("3"), 0)] == 1 and recorder.accepted[(_tree("3,1"), 0)] == 2
    assert recorder.mean_nodes()[(_tree("3"), 0)] == 1 + 3


def test_verify_timing_interleaves_sizes_and_takes_medians():
    from tokenswift_trt.decode.tuner_costs import time_verify

    calls = []
    costs = time_verify(calls.append, [1, 4, 16], repeats=3)
    assert calls == [1, 4, 16] + [1, 4, 16] * 3  # a warm-up each, then rounds over every size
    assert set(costs) == {1, 4, 16} and all(cost >= 0 for cost in costs.values())


def test_interpolation_and_plan_choice():
    costs = {1: 1.0, 8: 1.0, 64: 8.0}
    assert interpolate(costs, 1) == 1.0
    assert interpolate(costs, 36) == pytest.approx(4.5)
    assert interpolate(costs, 120) == pytest.approx(15.0)  # extrapolated from the last segment
    recorder = ProbeRecorder(max_depth=4)
    trie = _probe_trie()
    for _ in range(4):
        recorder.record(trie, _path(trie, [10, 20, 30, 40]))  # all rank 0: 1,1,1,1 accepts 4
    best, plans = choose_plan(recorder, costs, draft_s=1.0, overhead_s=0.0)
    assert best.tree == _tree("1,1,1,1") and best.ngram_topk == 0  # 5 tokens for 1 + 1 s
    assert best.tokens_per_s == pytest.approx(2.5)
    assert {p.tree for p in plans} >= set(CANDIDATE_TREES) | {None}
    slow_verify = {1: 1.0, 2: 100.0}
    best, _ = choose_plan(recorder, slow_verify, draft_s=1.0, overhead_s=0.0)
    assert best.tree is None  # drafting cannot pay off: plain AR steps
    assert all(len(p.tree.branching) <= 4 for p in plans if p.tree is not None)


def test_measured_sampling_costs_enter_every_plan():
    recorder = ProbeRecorder(max_depth=4)
    trie = _probe_trie()
    for _ in range(4):
        recorder.record(trie, _path(trie, [10, 20, 30, 40]))
    flat = {1: 1.0, 64: 1.0}
    # sampling: an AR step's 0.5 s, a batch of 5 nodes 1 s; 1,1,1,1 (5 nodes) gives 5 tokens in 1 + 1 s
    best, plans = choose_plan(
        recorder, flat, draft_s=0.0, overhead_s=0.0, sampling_costs={1: 0.5, 2: 1.0, 16: 1.0}
    )
    by_plan = {(p.tree, p.ngram_topk): p for p in plans}
    assert by_plan[(None, 0)].seconds_per_iteration == pytest.approx(1.5)
    assert by_plan[(_tree("1,1,1,1"), 0)].seconds_per_iteration == pytest.approx(2.0)
    assert best.tree == _tree("1,1,1,1")
    # above BATCHED_NODES_MAX nodes on a CPU a trie samples one node per committed token: 1,3,3,3 (41 nodes)
    # pays 5 x 0.5 s
    _, plans = choose_plan(
        recorder, flat, 0.0, 0.0, sampling_costs={1: 0.5, 2: 1.0, 16: 1.0}, device=torch.device("cpu")
    )
    assert {(p.tree, p.ngram_topk): p for p in plans}[
        (_tree("1,3,3,3"), 0)
    ].seconds_per_iteration == pytest.approx(1.0 + 2.5)
    # ... or one per 4 committed tokens where a visit samples 4 nodes down its path (greedy, keyed noise)
    _, plans = choose_plan(
        recorder,
        flat,
        0.0,
        0.0,
        sampling_costs={1: 0.5, 2: 1.0, 16: 1.0},
        device=torch.device("cpu"),
        chain_rows=4,
    )
    assert {(p.tree, p.ngram_topk): p for p in plans}[
        (_tree("1,3,3,3"), 0)
    ].seconds_per_iteration == pytest.approx(1.0 + 2 * 0.5)
    # drafting from the verify pass: batched tries draft from their own head pass (ranking only)
    _, plans = choose_plan(
        recorder,
        flat,
        3.0,
        0.0,
        sampling_costs={1: 0.5, 2: 1.0, 16: 1.0},
        device=torch.device("cpu"),
        batched_draft_s=0.25,
    )
    by_plan = {(p.tree, p.ngram_topk): p for p in plans}
    assert by_plan[(_tree("1,1,1,1"), 0)].seconds_per_iteration == pytest.approx(0.25 + 1.0 + 1.0)
    assert by_plan[(_tree("1,3,3,3"), 0)].seconds_per_iteration == pytest.approx(
        3.0 + 1.0 + 2.5
    )  # lazy: the full draft
    # sampling a batch so dear that drafting cannot pay: plain AR steps
    best, _ = choose_plan(recorder, flat, 0.0, 0.0, sampling_costs={1: 0.5, 2: 20.0, 16: 30.0})
    assert best.tree is None
    # drafting along tree paths costs one pass per level: by depth, replacing both draft costs
    by_depth = {1: 0.25, 2: 2.0, 3: 4.0, 4: 6.0}
    _, plans = choose_plan(
        recorder, flat, 3.0, 0.0, device=torch.device("cpu"), batched_draft_s=0.5, draft_s_by_depth=by_depth
    )
    by_plan = {(p.tree, p.ngram_topk): p for p in plans}
    assert by_plan[(_tree("1"), 0)].seconds_per_iteration == pytest.approx(0.25 + 1.0)
    assert by_plan[(_tree("1,1,1,1"), 0)].seconds_per_iteration == pytest.approx(6.0 + 1.0)
    assert by_plan[(_tree("1,1,1"), 0)].seconds_per_iteration == pytest.approx(4.0 + 1.0)


def test_auto_tree_generation_is_lossless_and_reports_its_plans(llama_engine64):
    prompt = list(range(3, 60))
    base = dict(
        max_new_tokens=160,
        sampling=SamplingConfig(temperature=0.9, min_p=0.05, penalty=1.2, penalty_window=16),
        seed=4,
        ignore_eos=True,
    )
    auto, stats = generate(llama_engine64, prompt, GenerationConfig(**base, tree="auto"))
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert auto == ar
    assert stats.plans[0].probe and len(stats.plans) >= 2
    # drafting from the verify pass, the probe runs AR steps and scores the probe trie's drafts
    assert (stats.plans[0].tree, str(stats.plans[0])) == (None, "probe on ar steps from token 1")
    paper, paper_stats = generate(
        llama_engine64, prompt, GenerationConfig(**base, tree="auto", draft_source="partial")
    )
    assert paper == ar
    probe = paper_stats.plans[0]  # a separate draft pass: the probe tree runs for real
    assert probe.probe and (probe.tree, probe.ngram_topk) == probe_plan("partial", torch.device("cpu"))
    chosen = stats.plans[1].tree
    assert chosen is None or chosen.branching


def test_candidates_need_no_more_ngrams_than_the_probe_had():
    recorder = ProbeRecorder(max_depth=3, probe_tree=_tree("3,2,1"), probe_topk=4)
    assert {k for _, _, k in recorder.candidates} == {0, 1, 2, 4}
    assert {tree for tree, _, _ in recorder.candidates} >= {
        _tree("1"),
        _tree("2"),
        _tree("3"),
        _tree("2,1"),
        _tree("3,2"),
        _tree("3,2,1"),
    }
    assert _tree("3,3") not in {tree for tree, _, _ in recorder.candidates}


def test_a_cpu_probes_a_smaller_trie_than_a_gpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for source in ("partial", "verify"):
        (cpu_tree, cpu_k), (gpu_tree, gpu_k) = probe_plan(source, cpu), probe_plan(source, gpu)
        cpu_nodes, gpu_nodes = (build_static_tree(tree.branching).num_nodes for tree in (cpu_tree, gpu_tree))
        assert cpu_nodes < gpu_nodes and cpu_k < gpu_k
    # the paper's tree and k where a verify is cheap
    assert probe_plan("partial", gpu) == (_tree("1,3,3,3"), 20)


def test_a_drafting_plan_is_kept_only_if_it_measures_faster_than_ar_steps(llama_engine64, monkeypatch):
    from tokenswift_trt.decode import autotune
    from tokenswift_trt.decode.autotune import Tuner
    from tokenswift_trt.decode.state import new_decode_state
    from tokenswift_trt.decode.tuner_costs import Estimate, IterationCosts
    from tokenswift_trt.model.sampling import PositionKeyedRandom

    monkeypatch.setattr(
        autotune, "choose_plan", lambda *args, **kwargs: (Estimate(_tree("1,1"), 0, 2.0, 1.0), [])
    )
    _stub_costs(monkeypatch)  # the cost model decides here
    engine = llama_engine64
    hidden = torch.zeros(engine.config.hidden_size, dtype=engine.dtype)
    probe = build_trie(5, build_static_tree("3,2,1"), [[10, 11, 12], [20, 21], [30]])
    small = build_trie(5, build_static_tree("1,1"), [[10], [20]])

    def settle(drafting_seconds_per_token: float):
        state = new_decode_state(
            engine, [5, 6, 7], GenerationConfig(max_new_tokens=900), PositionKeyedRandom(0)
        )
        tuner = Tuner(engine, state, True, 64, lambda: len(state.tokens))
        costs = IterationCosts(0.0, 0.0, 0.0, len(probe))
        while tuner.plan.probe:  # on AR steps: each one appends a token
            state.append([len(state.tokens) % 50])
            tuner.observe(None, [], None, hidden, False, 1.0, 1)
        assert tuner.recorder.iterations == autotune.SHADOW_PROBE_STEPS
        assert (tuner.plan.tree, tuner.plan.trial) == (_tree("1,1"), True)  # the model's pick, on trial
        turns, runs = [], {_tree("1,1"): 0, None: 0}
        while tuner.plan.trial:  # the pick (2 tokens an iteration) and AR steps (1 s a token) take turns
            tree = tuner.plan.tree
            if not turns or turns[-1][0] != tree:
                turns.append([tree, 0])
            turns[-1][1] += 1
            runs[tree] += 1
            if tree is None:
                tuner.observe(None, [], None, hidden, False, 1.0, 1)
            else:
                tuner.observe(small, [], costs, hidden, False, 2 * drafting_seconds_per_token, 2)
        pairs = 1 if drafting_seconds_per_token >= autotune.TRIAL_GIVE_UP else autotune.TURNS
        assert [tree for tree, _ in turns] == [_tree("1,1"), None] * pairs
        assert runs == {
            _tree("1,1"): autotune.TRIAL_ITERATIONS * pairs // autotune.TURNS,
            None: autotune.AR_TRIAL_STEPS * pairs // autotune.TURNS,
        }
        assert {count for tree, count in turns if tree is None} == {autotune.AR_TRIAL_STEPS // autotune.TURNS}
        return tuner.plan

    assert settle(0.5).tree == _tree("1,1")
    assert settle(2.0).tree is None  # given up after its first pair of turns: twice AR's time
    assert settle(0.99).tree is None  # within the trials' noise: plain AR steps stay


def test_a_trial_takes_turns_so_that_a_slow_spell_of_the_machine_hits_both_sides(llama_engine64, monkeypatch):
    """The machine runs 1.5x slower for the first half of the trial's tokens: had the pick run all its
    iterations and then AR steps all theirs, the pick would carry the slow spell and lose; taking turns,
    both sides see it alike and the pick, 20% faster, is kept."""
    from tokenswift_trt.decode import autotune
    from tokenswift_trt.decode.autotune import Tuner, describe_plans
    from tokenswift_trt.decode.state import new_decode_state
    from tokenswift_trt.decode.tuner_costs import Estimate, IterationCosts
    from tokenswift_trt.model.sampling import PositionKeyedRandom

    monkeypatch.setattr(
        autotune, "choose_plan", lambda *args, **kwargs: (Estimate(_tree("1,1"), 0, 2.0, 1.0), [])
    )
    _stub_costs(monkeypatch)  # the cost model decides here
    engine = llama_engine64
    hidden = torch.zeros(engine.config.hidden_size, dtype=engine.dtype)
    small = build_trie(5, build_static_tree("1,1"), [[10], [20]])
    costs = IterationCosts(0.0, 0.0, 0.0, len(small))
    state = new_decode_state(engine, [5, 6, 7], GenerationConfig(max_new_tokens=900), PositionKeyedRandom(0))
    tuner = Tuner(engine, state, True, 64, lambda: len(state.tokens) - 3)
    while tuner.plan.probe:
        state.append([len(state.tokens) % 50])
        tuner.observe(None, [], None, hidden, False, 1.0, 1)
    start = len(state.tokens)
    trial_tokens = 2 * autotune.TRIAL_ITERATIONS + autotune.AR_TRIAL_STEPS
    while tuner.plan.trial:
        slow = 1.5 if len(state.tokens) - start < trial_tokens // 2 else 1.0
        if tuner.plan.tree is None:
            state.append([len(state.tokens) % 50])
            tuner.observe(None, [], None, hidden, False, slow * 1.0, 1)
        else:
            state.append([len(state.tokens) % 50] * 2)
            tuner.observe(small, [], costs, hidden, False, slow * 2 * 0.8, 2)
    assert tuner.plan.tree == _tree("1,1") and not tuner.plan.trial
    described = describe_plans(tuner.history)
    assert (
        described[1] == f"trial 1,1 k=0 against ar steps, {2 * autotune.TURNS} turns, from token {start - 3}"
    )
    assert described[2] == f"1,1 k=0 from token {len(state.tokens) - 3}"


def test_ar_tokens_walk_the_trie_as_lossless_verification_would():
    from tokenswift_trt.decode.tuner_costs import accepted_path

    trie = build_trie(5, build_static_tree("3,2,1"), [[10, 11, 12], [20, 21], [30]], [(5, 11, 40, 41)], True)
    assert accepted_path(trie, [11, 21, 30, 7]) == [
        trie.children[0][11],
        trie.children[trie.children[0][11]][21],
        trie.children[trie.children[trie.children[0][11]][21]][30],
    ]
    assert len(accepted_path(trie, [11, 40, 41])) == 3  # along the n-gram branch
    assert accepted_path(trie, [13, 20]) == []  # the first token missed: nothing accepted
    assert len(accepted_path(trie, [10, 22, 30])) == 1


def test_a_probe_that_accepts_almost_nothing_settles_on_ar_steps_without_timing_verifies(
    llama_engine64, monkeypatch
):
    from tokenswift_trt.decode import autotune
    from tokenswift_trt.decode.autotune import Tuner
    from tokenswift_trt.decode.state import new_decode_state
    from tokenswift_trt.model.sampling import PositionKeyedRandom

    def never(*args, **kwargs):
        raise AssertionError(f"verify passes were timed: {max(tuner.recorder.accepted.values())} accepted")

    monkeypatch.setattr(autotune, "measure_verify", never)
    monkeypatch.setattr(autotune, "choose_plan", never)
    monkeypatch.setattr(autotune, "EXPLORATION_BUDGET", 1.0)  # steps of 1 s: the probe fits
    drafts = [[1, 2, 3], [4, 5], [6]]  # the probe trie's drafts at every root: never the token sampled
    monkeypatch.setattr(autotune, "candidates_from_hidden", lambda *args: drafts)
    engine = llama_engine64
    state = new_decode_state(engine, [5, 6, 7], GenerationConfig(max_new_tokens=900), PositionKeyedRandom(0))
    tuner = Tuner(engine, state, True, 64, lambda: len(state.tokens))
    hidden = torch.zeros(engine.config.hidden_size, dtype=engine.dtype)
    while tuner.plan.probe:
        state.append([10 + len(state.tokens) % 100])  # no draft, and no 4-gram repeats
        tuner.observe(None, [], None, hidden, False, 1.0, 1)
    assert tuner.plan.tree is None and not tuner.plan.trial
    assert tuner.recorder.iterations == autotune.SHADOW_PROBE_STEPS


def test_a_kept_drafting_plan_is_audited_against_ar_steps_and_dropped_when_it_stops_paying(
    llama_engine64, monkeypatch
):
    from tokenswift_trt.decode import autotune
    from tokenswift_trt.decode.tuner_costs import Estimate

    monkeypatch.setattr(
        autotune, "choose_plan", lambda *args, **kwargs: (Estimate(_tree("1,1"), 0, 2.0, 1.0), [])
    )
    _stub_costs(monkeypatch)

    def run(drafting_seconds_per_token: Callable[[int], float], tokens: int):
        """The plans of a tuner driven for `tokens` new tokens, the drafting plan taking
        `drafting_seconds_per_token(new tokens so far)`."""
        return _drive(llama_engine64, lambda tree, new: drafting_seconds_per_token(new), tokens).history

    def audit_starts(history) -> list[int]:
        return [
            plan.from_token for before, plan in zip(history, history[1:]) if plan.audit and not before.audit
        ]

    # faster in its trial, slower for good from token 300 on: an audit catches it and AR steps run
    history = run(lambda new: 0.5 if new < 300 else 3.0, 1500)
    audits = [plan for plan in history if plan.audit]
    assert audits and str(audits[0]).startswith("audit ar k=0 from token")  # AR steps first
    assert {plan.tree for plan in audits} == {None, _tree("1,1")}  # then taking turns with the plan
    assert history[-1].tree is None and not (history[-1].trial or history[-1].audit)
    settled_ar = next(
        plan for plan in history if plan.tree is None and not (plan.probe or plan.trial or plan.audit)
    )
    assert settled_ar.from_token < 1000  # dropped at the first audit after the slowdown
    # twice as fast early on, then 10% slower: each audit judges alone, so the plan's past does not
    # carry it (added up with its trial, the first audit would have measured 0.8x and kept it)
    history = run(lambda new: 0.5 if new < 300 else 1.1, 1500)
    assert history[-1].tree is None and len(audit_starts(history)) == 1
    # steadily a little faster (0.9 s a token): kept through audits spaced further and further apart
    history = run(lambda new: 0.9, 3000)
    audits = audit_starts(history)
    assert len(audits) >= 2 and history[-1].tree == _tree("1,1")
    gaps = [b - a for a, b in zip(audits, audits[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]
    # clearly faster (0.5 s a token): after one audit confirms it, no more until the next probe
    history = run(lambda new: 0.5, 2000)  # before the next probe (RETUNE_EVERY)
    assert len(audit_starts(history)) == 1 and history[-1].tree == _tree("1,1")


def test_the_ar_turns_of_trials_and_audits_score_every_candidate(llama_engine64, monkeypatch):
    """The probe trie drafted on the AR steps of a trial and of audits, as on a probe's: the candidates
    outside the running plan (`3` while `1,1` runs) keep learning from the text as it goes on."""
    from tokenswift_trt.decode import autotune
    from tokenswift_trt.decode.tuner_costs import Estimate

    _stub_costs(monkeypatch)
    monkeypatch.setattr(
        autotune, "choose_plan", lambda *args, **kwargs: (Estimate(_tree("1,1"), 0, 2.0, 1.0), [])
    )
    tuner = _drive(llama_engine64, lambda tree, new: 0.9, 600)  # a trial and one audit, passed
    described = autotune.describe_plans(tuner.history)
    assert [entry.split()[0] for entry in described] == ["probe", "trial", "1,1", "audit", "1,1"], described
    scored = tuner.shared.iterations
    # the probe's 32 AR steps, the trial's 32 and the audit's 32, each settled once 3 more tokens are
    # known: up to 3 of a turn's last wait for the next turn's tokens (the probe's: recorded since)
    expected = autotune.SHADOW_PROBE_STEPS + 2 * autotune.AR_TRIAL_STEPS
    assert expected - 3 <= scored <= expected + 3
    assert tuner.recorder.counts[(_tree("3"), 0)] == scored  # outside the running 1,1: only these samples
    assert tuner.recorder.counts[(_tree("1,1"), 0)] > scored  # inside it: its own iterations too


def test_a_passed_audit_tries_a_plan_the_shared_samples_favour_and_keeps_the_old_one_if_it_loses(
    llama_engine64, monkeypatch
):
    from tokenswift_trt.decode import autotune
    from tokenswift_trt.decode.tuner_costs import Estimate

    _stub_costs(monkeypatch)
    first, second = (
        Estimate(_tree("1,1"), 0, 2.0, 1.0),
        Estimate(_tree("3"), 0, 2.0, 0.9),
    )  # 3: 11% more tokens a second

    def choose(recorder, **kwargs):
        if choose.calls == 0:  # the probe's choice
            choose.calls += 1
            return first, [first, second]
        choose.calls += 1
        return second, [second, first]

    for slow_3, expected in ((2.0, _tree("1,1")), (0.4, _tree("3"))):
        choose.calls = 0
        monkeypatch.setattr(autotune, "choose_plan", choose)
        tuner = _drive(
            llama_engine64, lambda tree, new, slow=slow_3: slow if tree == _tree("3") else 0.5, 700
        )
        described = autotune.describe_plans(tuner.history)
        assert described[1].startswith("trial 1,1") and described[3].startswith("audit 1,1"), described
        assert described[4].startswith("trial 3 k=0 against ar steps"), described  # re-chosen after the audit
        assert choose.calls == 2  # the probe's choice, then one re-choice: no new samples, no third
        settled = [plan for plan in tuner.history if not (plan.probe or plan.trial or plan.audit)]
        assert settled[-1].tree == expected  # 3 lost its trial: 1,1 again, not AR steps


def test_a_probe_beyond_the_exploration_budget_is_abandoned_and_ar_steps_run_to_the_end(llama_engine64):
    """900 tokens at 1 s a step give 9 s to explore (EXPLORATION_BUDGET); a probe and its choice are
    expected to cost ~30 s (CHOOSE_COST_STEPS AR steps): the probe stops after its first shadow draft
    and the loop may run plain AR steps to the end, never asking again."""
    from tokenswift_trt.decode import autotune
    from tokenswift_trt.decode.autotune import Tuner
    from tokenswift_trt.decode.state import new_decode_state
    from tokenswift_trt.model.sampling import PositionKeyedRandom

    engine = llama_engine64
    state = new_decode_state(engine, [5, 6, 7], GenerationConfig(max_new_tokens=900), PositionKeyedRandom(0))
    tuner = Tuner(engine, state, True, 64, lambda: len(state.tokens) - 3)
    hidden = torch.zeros(engine.config.hidden_size, dtype=engine.dtype)
    assert tuner.plan.probe and tuner.plain_ar_steps() == 0  # a probe hears of every step
    while tuner.plan.probe:
        state.append([len(state.tokens) % 50])
        tuner.observe(None, [], None, hidden, False, 1.0, 1)
    assert tuner.plan.tree is None and tuner.recorder.iterations <= 1
    assert len(state.tokens) - 3 <= 4  # abandoned as soon as its first shadow draft is recorded
    while len(state.tokens) < state.limit:
        steps = tuner.plain_ar_steps()
        assert steps > 0  # settled on AR steps: the loop runs them as --method ar does
        state.append([len(state.tokens) % 50] * min(steps, state.limit - len(state.tokens)))
        tuner.observe(None, [], None, hidden, False, float(steps), steps)
        assert not tuner.plan.probe  # later probes do not fit either
    assert [plan.probe for plan in tuner.history] == [True, False]
    assert autotune.EXPLORATION_BUDGET * 900 < autotune.CHOOSE_COST_STEPS


def test_a_plans_text_is_its_trees_widths_or_ar_and_auto_is_not_a_plan():
    from tokenswift_trt.decode.autotune import Plan

    assert str(Plan(_tree("1,3,3,3"), 20, 5)) == "1,3,3,3 k=20 from token 5"
    assert str(Plan(None, 0, 7, audit=True)) == "audit ar k=0 from token 7"
    assert Plan(None, 0).branching == () and Plan(_tree("3,2,1"), 4).branching == (3, 2, 1)
    with pytest.raises(ValueError, match="not the tuner's `auto`"):
        Plan(_tree("auto"), 0)
