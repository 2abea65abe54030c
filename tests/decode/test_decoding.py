"""TokenSwift is lossless: greedy and seeded sampling equal AR token for token; stops; stats."""

from __future__ import annotations

import pytest
import torch

from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.loop import decode_steps, generate
from tokenswift_trt.model.sampling import IndependentRandom, SamplingConfig

from conftest import quiet_load
from helpers import PAPER_TREE

GREEDY = SamplingConfig(temperature=0)


def _prompts(vocab: int, count: int, length: int = 48) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(count)]


@pytest.mark.parametrize("length", [128, pytest.param(512, marks=pytest.mark.slow)])
@pytest.mark.parametrize("ngram_topk", [0, 20])
def test_greedy_tokenswift_equals_ar_equals_transformers(llama_dir, llama_engine64, ngram_topk, length):
    _, hf_model = llama_dir
    hf64 = hf_model.to(torch.float64)
    try:
        for prompt in _prompts(llama_engine64.config.vocab_size, 2):
            base = dict(max_new_tokens=length, sampling=GREEDY, ignore_eos=True)
            # budget 32 < context (48 + length): drafting runs on a selected partial cache
            swift, stats = generate(
                llama_engine64,
                prompt,
                GenerationConfig(tree=PAPER_TREE, **base, ngram_topk=ngram_topk, kv_budget=32),
            )
            ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
            with torch.no_grad():
                reference = hf64.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=length,
                    min_new_tokens=length,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(prompt) :].tolist()
            assert swift == ar == reference
            assert stats.partial_selections > 0
            assert stats.iterations < 512 and stats.accepted_tokens > 0
    finally:
        hf_model.to(torch.float32)


@pytest.mark.parametrize("draft_source", ["partial", "verify"])  # n-grams keyed by head 0's token / the root
def test_greedy_with_repetitive_prompt_uses_ngram_branches(llama_engine64, draft_source):
    prompt = [5, 6, 7, 8, 9] * 20
    config = GenerationConfig(
        max_new_tokens=300,
        sampling=GREEDY,
        ignore_eos=True,
        ngram_topk=20,
        kv_budget=64,
        draft_source=draft_source,
        tree="1,1,1" if draft_source == "verify" else "1,3,3,3",
    )
    swift, stats = generate(llama_engine64, prompt, config)
    ar, _ = generate(
        llama_engine64,
        prompt,
        GenerationConfig(max_new_tokens=300, sampling=GREEDY, ignore_eos=True, method="ar"),
    )
    assert swift == ar
    assert stats.ngram_accepted_tokens > 0 and 0 < stats.ngram_acceptance_rate <= stats.acceptance_rate <= 1


@pytest.mark.parametrize("tree", [PAPER_TREE, "auto"])  # the paper's tree; the default (verify-pass drafting)
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16),
        pytest.param(
            SamplingConfig(temperature=0.8, top_p=0.9, penalty=1.2, penalty_window=8), marks=pytest.mark.slow
        ),
        pytest.param(
            SamplingConfig(temperature=1.0, eta=0.02, top_k=30, penalty=1.5, penalty_window=4),
            marks=pytest.mark.slow,
        ),
        # a window longer than the context for the first 200 tokens: per-node windows are padded
        pytest.param(
            SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=256),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_seeded_sampling_tokenswift_equals_ar_token_for_token(llama_engine64, sampling, tree):
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    for seed in (0, 1, 2):
        base = dict(max_new_tokens=512, sampling=sampling, seed=seed, ignore_eos=True)
        swift, stats = generate(llama_engine64, prompt, GenerationConfig(tree=tree, **base, kv_budget=40))
        ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
        assert swift == ar
        assert stats.seed == seed


def test_drafts_ranked_with_the_targets_noise_are_accepted_whatever_the_entropy(llama_engine64):
    """The first tree level drafts from the root's own distribution (partial cache = full cache
    here). Ranked with the noise the target samples that position with, it is the target's token
    almost surely; ranked by probability (all a draft can do when the noise is drawn independently) it is
    accepted far less often."""
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    sampling = SamplingConfig(temperature=1.5)
    base = dict(max_new_tokens=200, sampling=sampling, seed=3, ignore_eos=True, tree="1", ngram_topk=0)
    swift, stats = generate(llama_engine64, prompt, GenerationConfig(**base, kv_budget=1024))
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert swift == ar
    assert stats.acceptance_rate > 0.9
    _, uncoupled = generate(
        llama_engine64, prompt, GenerationConfig(**base, kv_budget=1024), random=IndependentRandom(3)
    )
    assert uncoupled.acceptance_rate < 0.5


def test_different_seeds_give_different_samples(llama_engine64):
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    outputs = {
        tuple(
            generate(
                llama_engine64,
                prompt,
                GenerationConfig(tree=PAPER_TREE, max_new_tokens=40, seed=s, ignore_eos=True),
            )[0]
        )
        for s in range(3)
    }
    assert len(outputs) == 3


def test_stops_at_eos_unless_ignored(llama_engine64):
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    ar, _ = generate(
        llama_engine64,
        prompt,
        GenerationConfig(max_new_tokens=200, sampling=GREEDY, method="ar", ignore_eos=True),
    )
    eos = ar[57]  # pretend the 58th generated token is EOS
    from dataclasses import replace

    engine = replace(llama_engine64, config=replace(llama_engine64.config, eos_token_ids=(eos,)))
    first = ar.index(eos)
    for method in ("tokenswift", "ar"):
        out, stats = generate(
            engine, prompt, GenerationConfig(max_new_tokens=200, sampling=GREEDY, method=method)
        )
        assert out == ar[: first + 1] and stats.stop_reason == "eos"
        out, stats = generate(
            engine,
            prompt,
            GenerationConfig(max_new_tokens=200, sampling=GREEDY, method=method, ignore_eos=True),
        )
        assert out == ar and stats.stop_reason == "max_new_tokens"


def test_stops_at_engine_maximum_length_keeping_tokens(llama_engine64):
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    config = GenerationConfig(
        tree=PAPER_TREE, max_new_tokens=100, sampling=GREEDY, ignore_eos=True, max_length=len(prompt) + 30
    )
    out, stats = generate(llama_engine64, prompt, config)
    assert len(out) == 30 and stats.stop_reason == "max_length"
    full, _ = generate(
        llama_engine64,
        prompt,
        GenerationConfig(tree=PAPER_TREE, max_new_tokens=100, sampling=GREEDY, ignore_eos=True),
    )
    assert out == full[:30]


def test_streaming_callback_sees_every_token_in_order(llama_engine64):
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    seen: list[int] = []
    out, stats = generate(
        llama_engine64,
        prompt,
        GenerationConfig(tree=PAPER_TREE, max_new_tokens=100, seed=3, ignore_eos=True),
        on_tokens=seen.extend,
    )
    assert seen == out and stats.new_tokens == 100
    assert set(stats.phase_s) == {"draft", "trie", "verify", "accept", "commit"}
    assert stats.drafted_tokens == 4 * stats.iterations
    assert stats.forwards == 2 * stats.iterations  # a draft pass and a verify pass each
    assert stats.tokens_per_forward == pytest.approx(99 / stats.forwards)
    _, ar = generate(
        llama_engine64, prompt, GenerationConfig(max_new_tokens=100, seed=3, ignore_eos=True, method="ar")
    )
    assert ar.forwards == 99 and ar.tokens_per_forward == 1.0  # the first token comes from the prefill
    _, verify = generate(
        llama_engine64,
        prompt,
        GenerationConfig(max_new_tokens=100, seed=3, ignore_eos=True, tree="1,1", draft_source="verify"),
    )
    assert verify.forwards == verify.iterations


@pytest.mark.parametrize("method", ["ar", "tokenswift"])
def test_decode_steps_yields_every_iteration_and_returns_what_generate_does(llama_engine64, method):
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    config = GenerationConfig(tree=PAPER_TREE, max_new_tokens=40, seed=3, ignore_eos=True, method=method)
    steps = decode_steps(llama_engine64, prompt, config)
    counts = []
    while True:
        try:
            counts.append(next(steps).new_tokens)
        except StopIteration as done:
            tokens, stats = done.value
            break
    assert counts == sorted(counts) and counts[-1] == 40 and len(counts) == stats.iterations
    assert len(set(counts)) == len(counts)  # one yield per iteration, each committing tokens
    assert tokens == generate(llama_engine64, prompt, config)[0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=0), "max new tokens"),
        (dict(max_new_tokens=5, tree="1,x"), "tree"),
        (dict(max_new_tokens=5, tree="1,1,1,1,1"), "draft layers"),
        (dict(max_new_tokens=5, method="beam"), "method"),
        (dict(max_new_tokens=5, sampling=SamplingConfig(top_p=2.0)), "top-p"),
        (dict(max_new_tokens=5, max_length=48), "maximum length"),
        (dict(max_new_tokens=5, kv_budget=16, kv_recent=16), "recent region"),
        (dict(max_new_tokens=5, kv_recent=0), "recent region"),
    ],
)
def test_bad_requests_raise_generation_error(llama_engine64, kwargs, match):
    with pytest.raises(GenerationError, match=match):
        generate(llama_engine64, _prompts(llama_engine64.config.vocab_size, 1)[0], GenerationConfig(**kwargs))


def test_empty_and_out_of_vocabulary_prompts_are_refused(llama_engine64):
    with pytest.raises(GenerationError, match="empty"):
        generate(llama_engine64, [], GenerationConfig(max_new_tokens=5))
    with pytest.raises(GenerationError, match="token ids"):
        generate(llama_engine64, [1, 10_000], GenerationConfig(max_new_tokens=5))


def test_qwen2_tied_embeddings_greedy_lossless(qwen2_dir):
    engine = quiet_load(qwen2_dir[0], dtype=torch.float64)
    prompt = _prompts(engine.config.vocab_size, 1)[0]
    base = dict(max_new_tokens=200, sampling=GREEDY, ignore_eos=True)
    swift, _ = generate(engine, prompt, GenerationConfig(tree=PAPER_TREE, **base, kv_budget=32))
    ar, _ = generate(engine, prompt, GenerationConfig(**base, method="ar"))
    assert swift == ar


def test_a_smaller_recent_region_reselects_more_often_and_stays_lossless(llama_engine64):
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    base = dict(
        max_new_tokens=120,
        sampling=SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=16),
        seed=5,
        ignore_eos=True,
        kv_budget=32,
    )
    default, default_stats = generate(
        llama_engine64, prompt, GenerationConfig(tree=PAPER_TREE, **base)
    )  # recent region 8
    fresh, fresh_stats = generate(
        llama_engine64, prompt, GenerationConfig(tree=PAPER_TREE, **base, kv_recent=2)
    )
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert fresh == default == ar
    assert fresh_stats.partial_selections > 2 * default_stats.partial_selections > 0


@pytest.mark.parametrize("budget", [4, 9])
def test_tiny_partial_budgets_stay_lossless(llama_engine64, budget):
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    base = dict(max_new_tokens=120, sampling=GREEDY, ignore_eos=True)
    swift, stats = generate(
        llama_engine64, prompt, GenerationConfig(tree=PAPER_TREE, **base, kv_budget=budget)
    )
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert swift == ar and stats.partial_selections > 10


@pytest.mark.parametrize("tree", ["3,3,3", "1,1", "auto"])
def test_drafting_from_the_verify_pass_is_lossless(llama_engine64, tree):
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    base = dict(
        max_new_tokens=200,
        sampling=SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16),
        seed=2,
        ignore_eos=True,
    )
    swift, stats = generate(
        llama_engine64, prompt, GenerationConfig(**base, tree=tree, draft_source="verify")
    )
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert swift == ar and stats.partial_selections == 0
    if tree == "auto":  # probed on AR steps; untrained layers on a random model rarely earn a tree
        assert stats.plans[0].probe and stats.plans[0].tree is None
    else:
        assert "draft" in stats.phase_s


def test_verify_drafting_takes_the_next_drafts_from_the_verify_passs_head_pass(llama_engine64, monkeypatch):
    """Drafting from the verify pass, the draft layers' logits at the last accepted node come out of
    the same LM-head pass as the nodes' own (one pass per iteration): a separate draft-logits pass
    runs only on the first iteration, and the candidates equal what that pass would have given."""
    from tokenswift_trt.decode import loop as decoding
    from tokenswift_trt.decode import stages

    model = llama_engine64.model
    separate_passes = []
    original = model.draft_logits
    monkeypatch.setattr(model, "draft_logits", lambda *args: separate_passes.append(1) or original(*args))
    compared = []
    original_top = stages.top_candidates

    def checked_top(logits, state, tree):
        expected = original(state_hidden[0][None], llama_engine64.draft_layers, tree.depth)[:, 0]
        compared.append(torch.allclose(logits[: tree.depth], expected, rtol=1e-9, atol=1e-9))
        return original_top(logits, state, tree)

    state_hidden: list[torch.Tensor] = []
    original_candidates = decoding.candidates_from_hidden

    def spy_candidates(engine, state, hidden, tree, draft_logits=None):
        state_hidden[:] = [hidden]
        return original_candidates(engine, state, hidden, tree, draft_logits)

    monkeypatch.setattr(stages, "top_candidates", checked_top)
    monkeypatch.setattr(decoding, "candidates_from_hidden", spy_candidates)
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    base = dict(
        max_new_tokens=60, sampling=SamplingConfig(temperature=1.0, min_p=0.1), seed=4, ignore_eos=True
    )
    swift, stats = generate(
        llama_engine64, prompt, GenerationConfig(**base, tree="2,1", ngram_topk=0, draft_source="verify")
    )
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert swift == ar
    assert len(separate_passes) == 1  # the first iteration's (the checks call the original directly)
    assert len(compared) == stats.iterations and all(compared)


def test_verify_drafting_refuses_trees_deeper_than_the_draft_layers(llama_engine64):
    with pytest.raises(GenerationError, match="at most 3 levels"):
        generate(
            llama_engine64,
            [5, 6, 7],
            GenerationConfig(max_new_tokens=5, tree="1,3,3,3", draft_source="verify"),
        )


@pytest.mark.parametrize("window,committed", [(6, 20), (6, 3), (0, 10)])
def test_windows_of_many_paths_penalise_what_each_paths_own_window_does(window, committed):
    from tokenswift_trt.decode.stages import DecodeState
    from tokenswift_trt.model.kv_cache import KVCache
    from tokenswift_trt.model.sampling import PositionKeyedRandom, TorchSampler, apply_penalty

    sampling = SamplingConfig(penalty=1.3, penalty_window=window)
    tokens = list(range(10, 10 + committed))
    history = torch.zeros(64, dtype=torch.long)
    history[:committed] = torch.tensor(tokens)
    state = DecodeState(
        tokens=tokens,
        history=history,
        prompt_length=committed,
        limit=64,
        full=KVCache(1, 1, 4, 64),
        partial=None,
        table=None,
        random=PositionKeyedRandom(0),
        sampling=sampling,
        stop_tokens=frozenset(),
        sampler=TorchSampler(sampling),
    )
    paths = [[], [3], [3, 4], [5, 6, 7], [12, 40, 12, 41]]
    windows = state.windows(paths)
    logits = torch.randn(len(paths), 64, generator=torch.Generator().manual_seed(1))
    batched = apply_penalty(logits, windows, sampling.penalty)
    for row, path in enumerate(paths):
        assert torch.equal(batched[row], apply_penalty(logits[row], state.window(path), sampling.penalty))


@pytest.mark.parametrize("draft_source", ["partial", "verify"])
def test_auto_plans_alternating_with_ar_steps_stay_lossless(llama_engine64, monkeypatch, draft_source):
    """AR steps chosen by --tree auto skip the partial cache and n-gram upkeep; the next probe catches up."""
    from tokenswift_trt.decode import autotune
    from tokenswift_trt.decode.tree import TreeSpec
    from tokenswift_trt.decode.tuner_costs import Estimate

    pick = TreeSpec.parse("1,1")
    choices = iter([None, pick, None, pick, None, pick])
    monkeypatch.setattr(autotune, "EXPLORATION_BUDGET", 1e9)  # probes whatever they cost
    monkeypatch.setattr(autotune, "RETUNE_EVERY", 40)
    monkeypatch.setattr(autotune, "RETUNE_AFTER_AR", 20)  # AR steps teach nothing: probe again sooner
    monkeypatch.setattr(autotune, "PROBE_ITERATIONS", 4)
    monkeypatch.setattr(autotune, "TRIAL_ITERATIONS", 6)
    monkeypatch.setattr(autotune, "AR_TRIAL_STEPS", 6)
    monkeypatch.setattr(
        autotune, "choose_plan", lambda *args, **kwargs: (Estimate(next(choices), 2, 1.0, 1.0), [])
    )
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    base = dict(
        max_new_tokens=150,
        sampling=SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16),
        seed=4,
        ignore_eos=True,
    )
    swift, stats = generate(
        llama_engine64, prompt, GenerationConfig(**base, tree="auto", kv_budget=40, draft_source=draft_source)
    )
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert swift == ar
    plans = stats.plans
    assert plans[0].probe and plans[1].tree is None and not (plans[1].probe or plans[1].trial)
    assert plans[2].probe and plans[2].from_token - plans[1].from_token == 20  # RETUNE_AFTER_AR
    # the model's drafting pick is timed against AR steps before one of them is kept
    assert (plans[3].tree, plans[3].trial) == (pick, True) and (plans[4].tree, plans[4].trial) == (None, True)
    settled = next(plan for plan in plans[3:] if not plan.trial)  # after the turns of the trial
    assert settled.tree in (pick, None) and not settled.probe
    assert stats.phase_s["ar_step"] > 0
    if draft_source == "partial":
        assert stats.partial_selections >= 2  # after prefill, and again when drafting resumed


def test_drafted_tokens_count_the_tries_depth_when_ngram_branches_pass_the_tree(llama_engine64):
    """α = accepted / drafted stays a rate (≤ 1) when n-gram branches are deeper than the tree."""
    from tokenswift_trt.decode.stages import Acceptance

    depths: list[int] = []

    def accept_deepest(trie, targets, remaining, stop_tokens):  # not lossless: exercises the accounting only
        node = max(range(len(trie)), key=lambda n: trie.depths[n])
        depths.append(trie.depths[node])
        path = []
        while node > 0:
            path.append(node)
            node = trie.parents[node]
        nodes = path[::-1][: max(0, remaining - 1)]
        return Acceptance(
            nodes, [trie.tokens[n] for n in nodes] + [targets.sample(nodes[-1] if nodes else 0)]
        )

    config = GenerationConfig(max_new_tokens=60, sampling=GREEDY, ignore_eos=True, ngram_topk=5, tree="1")
    _, stats = generate(llama_engine64, [5, 6, 7, 8, 9] * 20, config, acceptor=accept_deepest)
    assert max(depths) >= 4 > 1  # a 4-gram branch (or a long match's) under a one-level tree
    assert stats.drafted_tokens == sum(depths) and stats.accepted_tokens <= stats.drafted_tokens
    assert stats.acceptance_rate <= 1
    # α by depth: every iteration reaches depth 1, each accepted draft counted at its own depth
    assert stats.reached_by_depth[0] == stats.iterations
    assert sum(stats.accepted_by_depth) == stats.accepted_tokens


def test_acceptance_by_depth_counts_the_iterations_that_reach_each_depth():
    from tokenswift_trt.decode.stats import Stats

    stats = Stats(method="tokenswift", seed=0)
    stats.count_depths(3, 1)  # depth 1 accepted, depth 2 rejected, depth 3 never reached
    stats.count_depths(2, 2)  # both accepted
    stats.count_depths(4, 0)  # rejected at depth 1
    assert stats.reached_by_depth == [3, 2, 0, 0] and stats.accepted_by_depth == [2, 1, 0, 0]
    assert stats.acceptance_by_depth == [2 / 3, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("draft_source", ["verify", "partial"])
@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16)]
)
def test_root_conditioned_drafts_read_the_root_and_stay_lossless(
    rooted_engine64, draft_source, sampling, monkeypatch
):
    """Drafting from the verify pass, every draft pass reads the root: the last token committed
    when it runs (the target's own sample); tokens equal AR's either way."""
    engine = rooted_engine64
    assert engine.draft_layers.root_conditioned
    prompt = _prompts(engine.config.vocab_size, 1)[0]
    committed = list(prompt)
    roots_seen: list[tuple[int, int]] = []
    original = engine.model.draft_logits

    def spy(hidden, layers, depth, roots=None):
        if roots is not None:
            roots_seen.append((int(roots[-1]), committed[-1]))
        return original(hidden, layers, depth, roots)

    monkeypatch.setattr(engine.model, "draft_logits", spy)
    base = dict(max_new_tokens=120, sampling=sampling, seed=6, ignore_eos=True)
    swift, stats = generate(
        engine,
        prompt,
        GenerationConfig(**base, tree="3,3,3", ngram_topk=0, draft_source=draft_source),
        on_tokens=committed.extend,
    )
    ar, _ = generate(engine, prompt, GenerationConfig(**base, method="ar"))
    assert swift == ar and stats.iterations < len(ar)
    if draft_source == "verify":  # one draft pass per iteration, each after the root it reads
        assert len(roots_seen) == stats.iterations
        assert all(root == last for root, last in roots_seen)


@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16)]
)
@pytest.mark.parametrize("tree", ["2,2,2", "auto"])
def test_path_drafts_follow_each_branch_and_stay_lossless(path_engine64, sampling, tree, monkeypatch):
    """Draft layers with a path input draft each level from the level before's nodes (one pass per
    level, one row per node), so depth-1 siblings get children of their own; tokens equal AR's."""
    import tokenswift_trt.decode.loop as decoding

    engine = path_engine64
    prompt = _prompts(engine.config.vocab_size, 1)[0]
    rows: list[tuple[bool, int]] = []
    tries = []
    path_logits, build_trie = engine.model.path_logits, decoding.build_trie

    def spy_levels(states, layers, tokens, first):
        rows.append((first, tokens.numel()))
        return path_logits(states, layers, tokens, first)

    def spy_trie(*args, **kwargs):
        tries.append(build_trie(*args, **kwargs))
        return tries[-1]

    monkeypatch.setattr(engine.model, "path_logits", spy_levels)
    monkeypatch.setattr(decoding, "build_trie", spy_trie)
    base = dict(max_new_tokens=120, sampling=sampling, seed=6, ignore_eos=True)
    config = GenerationConfig(**base, tree=tree, ngram_topk=0, draft_source="verify")
    swift, stats = generate(engine, prompt, config)
    ar, _ = generate(engine, prompt, GenerationConfig(**base, method="ar"))
    assert swift == ar
    if tree == "auto":
        return
    assert stats.iterations < len(ar) and len(rows) == 3 * len(tries)
    assert rows[:3] == [(True, 1), (False, 2), (False, 4)]  # the root, its 2 children, their 4

    def children(trie, node):
        return [trie.tokens[child] for child in trie.children[node].values()]

    depth_one = [[children(trie, n) for n, d in enumerate(trie.depths) if d == 1] for trie in tries]
    assert all(len(lists) == 2 for lists in depth_one)
    assert any(sorted(a) != sorted(b) for a, b in depth_one)  # siblings' own children


def test_path_drafts_of_a_node_do_not_depend_on_the_trees_size(path_engine64, monkeypatch):
    """The tuner counts what smaller trees would have accepted from a larger tree's nodes: a node's
    candidates must be the same in every tree that holds it, and the first level's what a one-level
    tree (layer 1, no path input) drafts."""
    import tokenswift_trt.decode.loop as decoding

    engine = path_engine64
    prompt = _prompts(engine.config.vocab_size, 1)[0]
    drafted = {}
    original = decoding.candidates_from_hidden

    def first_drafts(engine, state, hidden, tree, draft_logits=None):
        candidates = original(engine, state, hidden, tree, draft_logits)
        drafted.setdefault(tree.branching, candidates)
        return candidates

    monkeypatch.setattr(decoding, "candidates_from_hidden", first_drafts)
    sampling = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16)
    for tree in ("2", "2,2", "3,2"):
        config = GenerationConfig(
            max_new_tokens=8, sampling=sampling, seed=6, tree=tree, ngram_topk=0, draft_source="verify"
        )
        generate(engine, prompt, config)
    one, two, three = drafted[(2,)], drafted[(2, 2)], drafted[(3, 2)]
    assert isinstance(one, list) and isinstance(two, dict)  # per depth (one level) / per node
    assert two[()] == one[0] == three[()][:2]
    assert two[(0,)] == three[(0,)] and two[(1,)] == three[(1,)]
    assert len(three) == 4


def test_auto_settled_on_ar_steps_runs_them_as_the_ar_method_does(llama_engine64, monkeypatch):
    """--tree auto that settles on AR steps (here: a probe too costly for a 300-token generation's
    exploration budget) runs `--method ar`'s steps and tells the tuner about them a run at a time,
    not a step at a time; the tokens are AR's."""
    from tokenswift_trt.decode import autotune

    calls = []
    observe = autotune.Tuner.observe

    def counted(self, *args, **kwargs):
        calls.append(self.plan)
        return observe(self, *args, **kwargs)

    monkeypatch.setattr(autotune.Tuner, "observe", counted)
    prompt = _prompts(llama_engine64.config.vocab_size, 1)[0]
    base = dict(
        max_new_tokens=300,
        sampling=SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16),
        seed=3,
        ignore_eos=True,
    )
    auto, stats = generate(llama_engine64, prompt, GenerationConfig(**base))
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert auto == ar
    assert [plan.probe for plan in stats.plans] == [True, False] and stats.plans[1].tree is None
    settled = [plan for plan in calls if not plan.probe]
    assert 1 <= len(settled) <= 3 and stats.iterations == 299  # AR steps, reported in a few runs
    assert set(stats.phase_s) == {"ar_step"}
