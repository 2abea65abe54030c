"""One algorithm, two executors: the host loop (loop.py) and the device loop (device_loop.py, run
eagerly on the CPU) run the same stages, so they build the same tries and commit the same tokens,
iteration by iteration; and each stage's host form equals its device form on random inputs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenswift_trt.decode import loop as loop_module
from tokenswift_trt.decode.autotune import Plan
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.device_loop import DeviceLoop
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.stages import DecodeState, accept_slots, accept_trie
from tokenswift_trt.decode.tree import TreeSpec, TrieSlots, build_static_tree, build_trie
from tokenswift_trt.model.sampling import SamplingConfig

from conftest import quiet_load

GREEDY = SamplingConfig(temperature=0)
PAPER_SAMPLING = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16)


def _prompt(vocab: int, seed: int, length: int = 48) -> list[int]:
    """Random tokens with a repeated stretch, so that n-gram branches are offered and accepted."""
    tokens = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return tokens + tokens[5:25] + tokens[:12]


def _iterations(engine, prompt, config) -> tuple[list[list[int]], object]:
    chunks: list[list[int]] = []
    _, stats = generate(engine, prompt, config, on_tokens=lambda tokens: chunks.append(list(tokens)))
    return chunks, stats


@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
@pytest.mark.parametrize(
    "tree,ngram_topk,seed", [("3,3,3", 20, 1), ("2,1", 4, 2), ("1,1,1", 8, 3), ("3,2", 0, 4)]
)
def test_host_and_device_loops_commit_the_same_tokens_each_iteration(
    llama_engine64, sampling, tree, ngram_topk, seed
):
    """The same trie (draft candidates, the n-gram table's exact top-k), the same walk: every
    iteration commits the same tokens on both executors, and both are AR's."""
    prompt = _prompt(llama_engine64.config.vocab_size, seed)
    base = dict(max_new_tokens=90, sampling=sampling, seed=seed, ignore_eos=True)
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    config = GenerationConfig(**base, tree=tree, ngram_topk=ngram_topk, draft_source="verify")
    host, host_stats = _iterations(llama_engine64, prompt, replace(config, device_loop=False))
    device, device_stats = _iterations(llama_engine64, prompt, replace(config, device_loop=True))
    assert device == host and sum(host, []) == ar
    assert len(host) < len(ar)  # drafts were accepted
    assert device_stats.accepted_tokens == host_stats.accepted_tokens
    assert device_stats.ngram_accepted_tokens == host_stats.ngram_accepted_tokens


@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
def test_both_executors_offer_the_same_long_matches(llama_engine64, sampling):
    """A repeating prompt: the device loop's long-match slots (`suffix.match_tensors`) hold the branch
    the host loop adds (`SuffixIndex`): both offer the same depths and commit the same tokens."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 12  # greedy repeats itself after ~150 tokens
    base = dict(max_new_tokens=240, sampling=sampling, seed=7, ignore_eos=True)
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    config = GenerationConfig(**base, tree="1,1,1", ngram_topk=2, draft_source="verify")
    host, host_stats = _iterations(llama_engine64, prompt, replace(config, device_loop=False))
    device, device_stats = _iterations(llama_engine64, prompt, replace(config, device_loop=True))
    assert device == host and sum(host, []) == ar
    assert device_stats.drafted_tokens == host_stats.drafted_tokens  # the same depths offered
    assert device_stats.reached_by_depth == host_stats.reached_by_depth
    if sampling is GREEDY:  # the tree offers 3 levels every iteration; more: a long match's branch
        assert host_stats.drafted_tokens > 3 * host_stats.iterations


@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
def test_both_executors_offer_the_same_substituted_match(llama_engine64, sampling):
    """A prompt that repeats a passage after a token that a different one now follows: the first
    iteration's text matches only without its last token (the root), so both executors offer the
    substituted match's branch, 8 deep (past the tree's 3 levels), and commit AR's tokens."""
    passage, stand_in = list(range(5, 17)), 50
    prompt = passage + [stand_in] + list(range(17, 31)) + passage
    # 10 tokens: only the first iteration has room for a branch 8 deep (the bonus token is the last)
    base = dict(max_new_tokens=10, sampling=sampling, seed=7, ignore_eos=True)
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert ar[0] != stand_in  # the root stands in for it: no exact match
    config = GenerationConfig(**base, tree="1,1,1", ngram_topk=2, draft_source="verify")
    host, host_stats = _iterations(llama_engine64, prompt, replace(config, device_loop=False))
    device, device_stats = _iterations(llama_engine64, prompt, replace(config, device_loop=True))
    assert device == host and sum(host, []) == ar
    assert device_stats.reached_by_depth == host_stats.reached_by_depth
    assert len(host_stats.reached_by_depth) == 8  # the first iteration offered the 8-deep branch


@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
def test_both_executors_stop_at_a_stop_token_and_at_the_limit_in_the_same_iteration(llama_engine64, sampling):
    prompt = _prompt(llama_engine64.config.vocab_size, 5)
    base = dict(max_new_tokens=100, sampling=sampling, seed=6, ignore_eos=True)
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    eos = ar[41]
    stopping = replace(llama_engine64, config=replace(llama_engine64.config, eos_token_ids=(eos,)))
    config = GenerationConfig(**base, tree="3,3,3", ngram_topk=20, draft_source="verify")
    for engine, changes in (
        (stopping, dict(ignore_eos=False)),  # a stop token inside an accepted chain ends it there
        (llama_engine64, dict(max_length=len(prompt) + 37)),  # the engine's limit
        (llama_engine64, dict(max_new_tokens=29)),
    ):
        host, host_stats = _iterations(engine, prompt, replace(config, device_loop=False, **changes))
        device, device_stats = _iterations(engine, prompt, replace(config, device_loop=True, **changes))
        assert device == host and device_stats.stop_reason == host_stats.stop_reason
    assert sum(host, []) == ar[:29]


class ScriptedTuner:
    """The tuner's public face (`plan`, `history`, `plain_ar_steps`, `observe`) with its plans
    scripted: each plan runs for `runs` observed iterations (AR steps: `runs` steps in one run)."""

    script: list[tuple[TreeSpec | None, int, int]] = []  # (plan tree, n-gram k, iterations or AR steps)
    made: list[ScriptedTuner] = []

    def __init__(self, engine, state, from_verify, spare, clock) -> None:
        self.state, self.clock = state, clock
        self.steps = list(self.script)
        self.history: list[Plan] = []
        self.observed: list[tuple[TreeSpec | None, int]] = []  # (plan tree, tokens) per iteration
        self.left = 0
        self._next()
        ScriptedTuner.made.append(self)

    def _next(self) -> None:
        tree, topk, self.left = self.steps.pop(0) if self.steps else (None, 0, 10**6)
        self.history.append(Plan(tree, topk, self.clock()))

    @property
    def plan(self) -> Plan:
        return self.history[-1]

    def plain_ar_steps(self) -> int:
        return self.left if self.plan.tree is None else 0

    def observe(self, trie, accepted_nodes, costs, last_hidden, done, seconds=0.0, tokens=1) -> Plan:
        assert (trie is None) == (self.plan.tree is None) and seconds > 0
        if trie is not None:  # the device trie's features, as the tuner's recorder reads them
            assert trie.tree_paths[0] == () and len(accepted_nodes) == tokens - 1
            for node in accepted_nodes:
                assert trie.tree_paths[node] is not None or trie.ngram_ranks[node] is not None
        self.observed.append((self.plan.tree, tokens))
        self.left -= 1 if trie is not None else tokens
        if self.left <= 0:
            self._next()
        return self.plan


@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
def test_the_device_loop_runs_the_tuners_plans_and_ar_steps_in_turn(llama_engine64, monkeypatch, sampling):
    """`--tree auto` on the device loop: AR steps run as `--method ar`'s, each drafting plan on the
    device in its own slot layout; a plan the tuner leaves stops after the iteration in flight, which
    commits but is not reported; the tokens are AR's throughout."""
    tree_321, tree_1, tree_21 = (TreeSpec.parse(text) for text in ("3,2,1", "1", "2,1"))
    ScriptedTuner.script = [(None, 0, 7), (tree_321, 4, 5), (tree_1, 0, 4), (None, 0, 5), (tree_21, 2, 6)]
    ScriptedTuner.made = []
    monkeypatch.setattr(loop_module, "Tuner", ScriptedTuner)
    prompt = _prompt(llama_engine64.config.vocab_size, 7)
    base = dict(max_new_tokens=120, sampling=sampling, seed=8, ignore_eos=True)
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    auto, stats = generate(llama_engine64, prompt, GenerationConfig(**base, device_loop=True))
    assert auto == ar
    (tuner,) = ScriptedTuner.made
    plans = [plan.tree for plan in tuner.history]
    assert plans[:6] == [None, tree_321, tree_1, None, tree_21, None]
    observed = [tree for tree, _ in tuner.observed]
    assert observed[:1] == [None] and observed.count(tree_321) == 5 and observed.count(tree_1) == 4
    ar_steps = sum(tokens for tree, tokens in tuner.observed if tree is None)
    drafting = len([tree for tree in observed if tree is not None])
    assert (
        stats.iterations - ar_steps - drafting == 3
    )  # each drafting plan's iteration in flight when it ended
    assert stats.accepted_tokens > 0 and stats.phase_s["ar_step"] > 0 and "wait" in stats.phase_s


@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
def test_auto_on_the_device_loop_with_the_real_tuner_gives_ars_tokens(llama_engine64, sampling):
    prompt = _prompt(llama_engine64.config.vocab_size, 9)
    base = dict(max_new_tokens=200, sampling=sampling, seed=10, ignore_eos=True)
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    auto, stats = generate(llama_engine64, prompt, GenerationConfig(**base, device_loop=True))
    assert auto == ar and stats.plans and stats.plans[0].probe


def test_the_default_runs_the_host_loop_on_a_cpu_and_the_device_loop_with_cuda(llama_engine64):
    config = GenerationConfig(max_new_tokens=8)
    random = loop_module.PositionKeyedRandom(1)
    assert not config.runs_device_loop(llama_engine64, random)  # the CPU: the host loop
    cuda = replace(llama_engine64, device=torch.device("cuda"))
    assert config.runs_device_loop(cuda, random)
    assert not replace(config, device_loop=False).runs_device_loop(cuda, random)
    assert not replace(config, draft_source="partial").runs_device_loop(cuda, random)  # the host loop's
    assert replace(config, adapt_drafts=True).runs_device_loop(cuda, random)  # it adapts there too
    assert replace(config, sampling=SamplingConfig(eta=0.1)).runs_device_loop(cuda, random)  # no read back
    assert not replace(config, method="ar").runs_device_loop(cuda, random)


# ---------------------------------------------------------------- the stages' two forms


def _random_trie_case(generator: torch.Generator, vocab: int = 6):
    """A static tree filled with candidates from a small vocabulary (distinct per depth, as a ranking's
    are; many duplicate paths with the n-grams), and n-grams."""
    tree = build_static_tree("2,2,1")
    ranked = torch.stack([torch.randperm(vocab, generator=generator)[:2] for _ in range(3)])  # [3, 2]
    grams = torch.randint(0, vocab, (4, 3), generator=generator)
    valid = (torch.rand(4, generator=generator) < 0.7).sort(descending=True).values  # valid grams first
    return tree, ranked, grams, valid


def _host_trie(tree, ranked, grams, valid):
    paths = [[0] + g for g, v in zip(grams.tolist(), valid.tolist()) if v]
    return build_trie(0, tree, ranked.tolist(), paths, ngrams_from_root=True)


def _host_path(trie, node: int) -> list[int]:
    nodes = []
    while node > 0:
        nodes.append(node)
        node = trie.parents[node]
    return nodes[::-1]


def _device_path(trie, slot: int) -> tuple[int, ...]:
    """The tokens after the root on a device trie slot's path, read from its mask row."""
    ancestors = [j for j in range(trie.mask.shape[0]) if trie.mask[slot, j] and j != 0]
    return tuple(trie.tokens[j].item() for j in sorted(ancestors, key=lambda j: trie.depths[j].item()))


def _slot_features(trie, features) -> dict[tuple[int, ...], tuple]:
    """Each live slot's path -> (static-tree rank path, best n-gram rank) as the tuner reads them."""
    return {
        _device_path(trie, slot): (features.tree_paths[slot], features.ngram_ranks[slot])
        for slot in range(trie.live.numel())
        if trie.live[slot]
    }


def _node_features(host) -> dict[tuple[int, ...], tuple]:
    """`_slot_features` of a host trie."""
    return {
        tuple(host.tokens[a] for a in _host_path(host, node)): (host.tree_paths[node], host.ngram_ranks[node])
        for node in range(len(host))
    }


def test_both_trie_forms_hold_the_same_paths_with_the_same_tuner_features():
    """Every path once in both; each live slot's static-tree rank path and best n-gram rank
    (what the tuner reads, `TrieSlots.features`) equal the host node's."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(60):
        tree, ranked, grams, valid = _random_trie_case(generator)
        slots = TrieSlots(tree, ngram_topk=4, size=32, device=torch.device("cpu"))
        trie = slots.assemble(torch.tensor(0), ranked, grams, valid)
        host = _host_trie(tree, ranked, grams, valid)
        features = slots.features(trie.ngram_ranks.tolist())
        assert _slot_features(trie, features) == _node_features(host)
        assert [features.tree_paths[s] for s in range(32) if not trie.live[s]] == [None] * (32 - len(host))


def test_a_long_matchs_slots_hold_the_host_branch_with_its_tuner_features():
    """A long match's slots beside the tree and the n-grams (sharing their paths by chance in a small
    vocabulary): the same paths as the host trie with the branch added as rank 0, the same features."""
    generator = torch.Generator().manual_seed(4)
    for _ in range(60):
        tree, ranked, grams, valid = _random_trie_case(generator, vocab=3)
        branch = torch.randint(0, 3, (6,), generator=generator)
        depth = int(torch.randint(0, 7, (1,), generator=generator))
        slots = TrieSlots(tree, ngram_topk=4, size=40, device=torch.device("cpu"), long_depth=6)
        trie = slots.assemble(torch.tensor(0), ranked, grams, valid, branch, torch.arange(6) < depth)
        host = _host_trie(tree, ranked, grams, valid)
        if depth:
            host.add_path(branch[:depth].tolist(), from_tree=False, ngram_rank=0)
        assert _slot_features(trie, slots.features(trie.ngram_ranks.tolist())) == _node_features(host)


class _Samples:
    def __init__(self, table: dict[tuple[int, ...], int], trie) -> None:
        self.table, self.trie = table, trie

    def sample(self, node: int) -> int:
        return self.table[tuple(self.trie.tokens[n] for n in _host_path(self.trie, node))]


def test_both_walks_accept_the_same_chain_with_stops_and_limits():
    """Samples are a function of the path (as the target's are); `accept_slots` on the device trie
    emits `accept_trie`'s tokens on the host trie, its chain is the host's accepted nodes' paths, and
    both cut at a stop token and at the limit."""
    generator = torch.Generator().manual_seed(4)
    for case in range(200):
        tree, ranked, grams, valid = _random_trie_case(generator, vocab=3)
        slots = TrieSlots(tree, ngram_topk=4, size=32, device=torch.device("cpu"))
        trie = slots.assemble(torch.tensor(0), ranked, grams, valid)
        paths: dict[tuple[int, ...], int] = {}
        samples = []
        for slot in range(32):
            key = _device_path(trie, slot)
            paths.setdefault(key, int(torch.randint(0, 3, (1,), generator=generator)))
            samples.append(paths[key])
        remaining = 2 + case % 4
        stops = frozenset({case % 5}) if case % 3 == 0 else frozenset()
        result = accept_slots(
            trie, torch.tensor(samples), torch.tensor(remaining), torch.tensor(sorted(stops)), 3
        )
        host = _host_trie(tree, ranked, grams, valid)
        expected = accept_trie(host, _Samples(paths, host), remaining, stops)
        count = int(result.count)
        assert result.emitted[:count].tolist() == expected.tokens
        chain = [_device_path(trie, slot) for slot in result.chain[1:count].tolist()]
        assert chain == [tuple(host.tokens[a] for a in _host_path(host, n)) for n in expected.nodes]
        stopped = expected.tokens[-1] in stops or len(expected.tokens) >= remaining
        assert bool(result.stopped) == stopped


@pytest.mark.parametrize("window", [4, 16])
def test_both_window_forms_give_every_path_the_same_penalised_tokens(window):
    """`DecodeState.slot_windows` (device) and `windows` / `window` (host) hold the same tokens per
    path (padding repeats a token already in the row, which a penalty counts once)."""
    generator = torch.Generator().manual_seed(5)
    history = torch.randint(0, 50, (64,), generator=generator)
    for committed in (1, 3, 20):
        state = DecodeState.__new__(DecodeState)
        state.tokens, state.history = history[:committed].tolist(), history
        state.sampling = SamplingConfig(temperature=1.0, penalty=1.2, penalty_window=window)
        paths = torch.randint(0, 50, (6, 3), generator=generator)
        depths = torch.tensor([0, 1, 2, 3, 3, 2])
        paths = torch.where(torch.arange(3)[None, :] < depths[:, None], paths, -1)
        device = state.slot_windows(torch.tensor(committed), paths, depths)
        committed_window = state.slot_windows(torch.tensor(committed))
        assert (
            set(committed_window.tolist()) == set(state.window().tolist()) and len(committed_window) == window
        )
        for row, depth in enumerate(depths.tolist()):
            path = paths[row, :depth].tolist()
            assert set(device[row].tolist()) == set(state.window(path).tolist())
            assert set(state.windows([path])[0].tolist()) == set(state.window(path).tolist())


class _OpCounter(TorchDispatchMode):
    """Counts the torch operations dispatched on the host while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU and a CUDA build of torch"
)
@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
def test_a_default_generate_on_cuda_replays_captured_iterations(llama_dir, monkeypatch, sampling):
    """No --tree, no --device-loop: on CUDA the request runs the device loop under the tuner, each
    drafting plan captured once as its own graph, every iteration of it a replay that dispatches no
    operation on the host (what remains per iteration is the report's copy and its late read)."""
    engine = quiet_load(llama_dir[0], dtype=torch.float64, device="cuda")  # float64: no near-ties
    prompt = _prompt(engine.config.vocab_size, 11)
    base = dict(max_new_tokens=160, sampling=sampling, seed=3, ignore_eos=True)
    ar, _ = generate(engine, prompt, GenerationConfig(**base, method="ar"))
    config = GenerationConfig(**base)
    assert config.runs_device_loop(engine, loop_module.PositionKeyedRandom(3))
    ran = []
    device_loop = loop_module._device_loop
    monkeypatch.setattr(loop_module, "_device_loop", lambda *args: ran.append(1) or device_loop(*args))
    auto, stats = generate(engine, prompt, config)  # the real tuner
    assert auto == ar and ran == [1] and stats.plans[0].probe
    # the tuner's plans scripted, so that drafting plans run on this random model
    wide, small = TreeSpec.parse("3,3,3"), TreeSpec.parse("1,1")
    ScriptedTuner.script = [(None, 0, 8), (wide, 20, 20), (small, 4, 15), (wide, 20, 15)]
    ScriptedTuner.made = []
    monkeypatch.setattr(loop_module, "Tuner", ScriptedTuner)
    launches: list[int] = []
    launch = DeviceLoop.launch

    def counted(self, plan) -> None:
        with _OpCounter() as counter:
            launch(self, plan)
        launches.append(counter.ops)

    monkeypatch.setattr(DeviceLoop, "launch", counted)
    auto, stats = generate(engine, prompt, config)
    assert auto == ar
    # "3,3,3" once though it ran twice, "1,1" once (and again per attention route, where it changes)
    assert 2 <= stats.graph_captures <= 4
    assert stats.graph_replays == len(launches) >= 50 and set(launches) == {0}
