"""The device-resident iteration (device_loop.py), run eagerly on the CPU: its tokens equal AR's and the
host loop's, its trie and walk equal the host's, its noise and n-gram table do what they claim."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tokenswift_trt.decode.device_loop import DeviceLoop, DeviceNgramTable, TrieSlots, walk
from tokenswift_trt.decode.loop import GenerationConfig, GenerationError, generate
from tokenswift_trt.decode.stages import accept_trie
from tokenswift_trt.decode.tree import build_static_tree, build_trie
from tokenswift_trt.model import sampling
from tokenswift_trt.model.sampling import PositionKeyedRandom, SamplingConfig, position_gumbel_tensor

from conftest import quiet_load

GREEDY = SamplingConfig(temperature=0)
PAPER_SAMPLING = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16)


def _prompt(vocab: int, length: int = 48) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
@pytest.mark.parametrize("tree,ngram_topk", [("3,3,3", 20), ("1,1", 0)])
def test_device_loop_tokens_equal_ar_and_the_host_loop(llama_engine64, sampling, tree, ngram_topk):
    prompt = _prompt(llama_engine64.config.vocab_size)
    base = dict(max_new_tokens=160, sampling=sampling, seed=2, ignore_eos=True)
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    config = GenerationConfig(**base, tree=tree, ngram_topk=ngram_topk, draft_source="verify")
    host, host_stats = generate(llama_engine64, prompt, config)
    streamed: list[int] = []
    device, stats = generate(
        llama_engine64, prompt, replace(config, device_loop=True), on_tokens=streamed.extend
    )
    assert device == ar == host and streamed == device
    assert stats.stop_reason == "max_new_tokens" and stats.new_tokens == len(device)
    # the same trie contents (up to the n-gram table's rule) accept about as much as the host's
    assert stats.iterations < len(device) and stats.forwards == stats.iterations
    assert "host" in stats.phase_s and "wait" in stats.phase_s
    assert abs(stats.accepted_tokens - host_stats.accepted_tokens) <= 0.2 * host_stats.accepted_tokens + 3


def test_device_loop_through_the_flash_cascade_gives_ars_tokens(llama_engine64, monkeypatch):
    """The device loop's fixed-shape verify with tree attention as a FlashAttention cascade (CPU flash
    op here): AR's tokens under sampling, with n-gram branches."""
    monkeypatch.setattr(llama_engine64.model, "attention_kernel", "flash_cascade")
    prompt = _prompt(llama_engine64.config.vocab_size)
    base = dict(max_new_tokens=96, sampling=PAPER_SAMPLING, seed=2, ignore_eos=True)
    config = GenerationConfig(**base, tree="3,3,3", ngram_topk=20, draft_source="verify", device_loop=True)
    device, stats = generate(llama_engine64, prompt, config)
    monkeypatch.setattr(llama_engine64.model, "attention_kernel", "sdpa")
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert device == ar and stats.iterations < len(device)


def test_device_loop_moves_to_the_cascade_once_the_context_makes_it_pay(llama_engine64, monkeypatch):
    """A long generation from a short prompt under `auto`: the fallback's route while T x keys is under
    the cascade's threshold, the cascade's once the committed length the host has read passes it (one
    iteration per route), and AR's tokens throughout."""
    from tokenswift_trt.decode import device_loop

    model = llama_engine64.model
    routes: list[bool | None] = []

    def recorded(*args):  # fixed_shape_forward, noting the route each iteration's verify took
        routes.append(args[7])  # (model, cache, tokens, positions, mask, length, columns, route, aligned)
        return fixed_shape_forward(*args)

    fixed_shape_forward = device_loop.fixed_shape_forward
    monkeypatch.setattr(device_loop, "fixed_shape_forward", recorded)
    for name in ("attention_kernel", "cascade_min_work", "cascade_fallback"):
        monkeypatch.setattr(model, name, getattr(model, name))  # put back after the test
    slots = 40 + 20 * 3  # tree 3,3,3 and 20 n-gram branches (no bucket on the CPU)
    model.use_flash_cascade(slots * (48 + 1 + 60 + slots), "sdpa")  # passed ~60 tokens in
    prompt = _prompt(llama_engine64.config.vocab_size)
    base = dict(max_new_tokens=140, sampling=PAPER_SAMPLING, seed=2, ignore_eos=True)
    config = GenerationConfig(**base, tree="3,3,3", ngram_topk=20, draft_source="verify", device_loop=True)
    device, _ = generate(llama_engine64, prompt, config)
    model.use_attention_kernel("sdpa")
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    assert device == ar
    assert routes[0] is False and routes[-1] is True and routes == sorted(routes)  # moved once, stayed


class HostValueCopies(TorchDispatchMode):
    """Records operations that read a tensor made from Python data (`lift_fresh`: `x[i] = True`,
    `torch.tensor(...)`). On a GPU each is a copy from ordinary host memory, which a CUDA graph
    capture refuses; a fill with a Python value (`fill_.Scalar`) is a kernel argument instead."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: list[torch.Tensor] = []
        self.found: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        if func.overloadpacket.__name__ == "lift_fresh":
            self.fresh.append(out)
        else:  # every tensor the op reads, nested in lists (cat, index_put_'s indices) or keywords too
            inputs = tree_flatten((args, kwargs))[0]
            if any(a is t for a in inputs for t in self.fresh):
                self.found.append(str(func))
        return out


@pytest.mark.parametrize("kernel", ["default", "flash_cascade"])
def test_device_loop_iteration_copies_no_host_values(llama_engine64, monkeypatch, kernel):
    """What CUDA graph capture needs, checked on the CPU: no operation of an iteration reads a
    tensor made from host data (on a GPU such a read makes the walk see `matched[0] = True`); the
    FlashAttention cascade's verify included (its key ranges come from the device-side length)."""
    if kernel != "default":  # the shared engine gets its kernel back after the test
        monkeypatch.setattr(llama_engine64.model, "attention_kernel", kernel)
    recorder = HostValueCopies()
    step = DeviceLoop.step

    def recorded_step(self, route: bool | None = None) -> None:
        with recorder:
            step(self, route)

    monkeypatch.setattr(DeviceLoop, "step", recorded_step)
    prompt = _prompt(llama_engine64.config.vocab_size)
    config = GenerationConfig(
        max_new_tokens=24,
        sampling=PAPER_SAMPLING,
        seed=2,
        ignore_eos=True,
        tree="3,3,3",
        draft_source="verify",
        device_loop=True,
    )
    generate(llama_engine64, prompt, config)
    assert recorder.ops > 100  # it saw the iterations' operations
    assert recorder.found == []


@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
def test_device_loop_with_root_conditioned_layers_drafts_what_the_host_loop_does(rooted_engine64, sampling):
    """Root-conditioned layers read the last slot's sample after the walk: the device loop offers
    the host loop's drafts (same acceptance, no n-grams) and both give AR's tokens."""
    prompt = _prompt(rooted_engine64.config.vocab_size)
    base = dict(max_new_tokens=120, sampling=sampling, seed=2, ignore_eos=True)
    ar, _ = generate(rooted_engine64, prompt, GenerationConfig(**base, method="ar"))
    config = GenerationConfig(**base, tree="3,3,3", ngram_topk=0, draft_source="verify")
    host, host_stats = generate(rooted_engine64, prompt, config)
    device, stats = generate(rooted_engine64, prompt, replace(config, device_loop=True))
    assert device == ar == host
    assert stats.accepted_tokens == host_stats.accepted_tokens and stats.iterations == host_stats.iterations


def test_device_loop_accepts_ngram_branches_on_a_repetitive_prompt(llama_engine64):
    prompt = [5, 6, 7, 8, 9] * 20
    base = dict(max_new_tokens=200, sampling=GREEDY, ignore_eos=True)
    ar, _ = generate(llama_engine64, prompt, GenerationConfig(**base, method="ar"))
    config = GenerationConfig(**base, tree="1,1,1", ngram_topk=20, draft_source="verify")
    _, host = generate(llama_engine64, prompt, config)
    device, stats = generate(llama_engine64, prompt, replace(config, device_loop=True))
    assert device == ar
    assert stats.ngram_accepted_tokens > 0 and stats.mean_accept_length > 1.3
    assert stats.accepted_tokens >= 0.8 * host.accepted_tokens  # the device table serves as well


def test_device_loop_stops_at_eos_and_at_the_maximum_length(llama_engine64):
    prompt = _prompt(llama_engine64.config.vocab_size)
    ar, _ = generate(
        llama_engine64,
        prompt,
        GenerationConfig(max_new_tokens=120, sampling=GREEDY, method="ar", ignore_eos=True),
    )
    eos = ar[57]
    engine = replace(llama_engine64, config=replace(llama_engine64.config, eos_token_ids=(eos,)))
    config = GenerationConfig(max_new_tokens=120, sampling=GREEDY, tree="3,3,3", device_loop=True)
    out, stats = generate(engine, prompt, config)
    assert out == ar[: ar.index(eos) + 1] and stats.stop_reason == "eos"
    out, stats = generate(
        llama_engine64, prompt, replace(config, ignore_eos=True, max_length=len(prompt) + 30)
    )
    assert out == ar[:30] and stats.stop_reason == "max_length"


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(tree="auto"), "fixed tree"),
        (dict(tree="3,3,3", draft_source="partial"), "verify pass"),
    ],
)
def test_device_loop_refuses_what_it_does_not_run(llama_engine64, changes, match):
    config = GenerationConfig(max_new_tokens=8, device_loop=True, **changes)
    with pytest.raises(GenerationError, match=match):
        generate(llama_engine64, [5, 6, 7], config)


def test_device_noise_is_the_host_keyed_noise_bit_for_bit():
    """Keys hashed on the device equal the pure-Python hash of (seed, position) the noise was
    defined with (seeded outputs and journals depend on it), and PositionKeyedRandom serves them."""
    positions = [0, 1, 17, 4095, 2**40]
    mask = (1 << 64) - 1
    keys = [
        sampling._signed(sampling._splitmix64(sampling._splitmix64(12345) ^ (p & mask))) for p in positions
    ]
    python_keyed = -torch.log(-torch.log(sampling.keyed_uniform_rows(torch.tensor(keys), torch.arange(300))))
    device = position_gumbel_tensor(12345, torch.tensor(positions), torch.arange(300))
    host = PositionKeyedRandom(seed=12345).gumbel_rows(positions, 300, torch.device("cpu"))
    assert torch.equal(python_keyed, device) and torch.equal(host, device)


def test_device_ngram_table_counts_and_ranks_grams():
    table = DeviceNgramTable(vocab=10, k=2, device=torch.device("cpu"))
    on = torch.ones((), dtype=torch.bool)
    for gram in ([1, 2, 3, 4], [1, 5, 6, 7], [1, 5, 6, 7], [2, 3, 4, 5]):
        table.add(torch.tensor(gram), on)
    table.add(torch.tensor([1, 9, 9, 9]), torch.zeros((), dtype=torch.bool))  # not valid: ignored
    grams, valid = table.top(torch.tensor(1))
    assert grams.tolist() == [[5, 6, 7], [2, 3, 4]] and valid.tolist() == [True, True]
    assert table.counts[1].sort(descending=True).values.tolist() == [2, 1]
    # full row: a new gram replaces the least counted one and takes its count + 1 (Space-Saving)
    table.add(torch.tensor([1, 8, 8, 8]), on)
    grams, _ = table.top(torch.tensor(1))
    assert sorted(grams.tolist()) == [[5, 6, 7], [8, 8, 8]] and table.counts[1].tolist() == [2, 2]
    grams, valid = table.top(torch.tensor(3))
    assert valid.tolist() == [False, False]


def test_device_ngram_table_fills_from_a_whole_prompt_with_each_starts_k_most_counted_grams():
    """add_all in a few vectorised ops: the exact counts, the k most counted grams per start token,
    ties to the earlier first occurrence (a small vocabulary so most starts have more than k grams)."""
    from collections import Counter

    tokens = torch.randint(0, 5, (600,), generator=torch.Generator().manual_seed(4))
    table = DeviceNgramTable(vocab=5, k=3, device=torch.device("cpu"))
    table.add_all(tokens)
    listed = tokens.tolist()
    grams = [tuple(listed[i : i + 4]) for i in range(len(listed) - 3)]
    counts, first = Counter(grams), {}
    for position, gram in enumerate(grams):
        first.setdefault(gram, position)
    for start in range(5):
        ranked = sorted((g for g in counts if g[0] == start), key=lambda g: (-counts[g], first[g]))[:3]
        got, valid = table.top(torch.tensor(start))
        assert [tuple([start, *row]) for row in got.tolist()] == ranked and valid.all()
        assert table.counts[start].tolist() == [counts[g] for g in ranked]
    assert sum(counts[g] for g in counts if g[0] == 4) > table.counts[4].sum()  # some grams left out
    short = DeviceNgramTable(vocab=5, k=3, device=torch.device("cpu"))
    short.add_all(tokens[:3])  # no whole gram
    assert not short.counts.any()
    with pytest.raises(ValueError, match="empty"):
        table.add_all(tokens)


def _random_trie_case(generator: torch.Generator, vocab: int = 6):
    """A static tree filled with candidates from a small vocabulary (many duplicates), and n-grams."""
    tree = build_static_tree("2,2,1")
    ranked = torch.randint(0, vocab, (3, 2), generator=generator)
    grams = torch.randint(0, vocab, (4, 3), generator=generator)
    valid = torch.rand(4, generator=generator) < 0.7
    return tree, ranked, grams, valid


def test_device_trie_holds_the_host_tries_paths_once_each():
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        tree, ranked, grams, valid = _random_trie_case(generator)
        slots = TrieSlots(tree, ngram_topk=4, size=32, device=torch.device("cpu"))
        trie = slots.assemble(torch.tensor(0), ranked, grams, valid)
        host = build_trie(
            0,
            tree,
            ranked.tolist(),
            [[0] + g for g, v in zip(grams.tolist(), valid.tolist()) if v],
            ngrams_from_root=True,
        )

        live = [slot for slot in range(32) if trie.live[slot]]
        device_paths = sorted(_device_path(trie, slot) for slot in live)
        host_paths = sorted(
            tuple(host.tokens[a] for a in _host_path(host, node)) for node in range(len(host))
        )
        assert device_paths == host_paths  # every path once, the same paths


def _device_path(trie, slot: int) -> tuple[int, ...]:
    """The tokens after the root on a device trie slot's path, read from its mask row."""
    ancestors = [j for j in range(trie.mask.shape[0]) if trie.mask[slot, j] and j != 0]
    return tuple(trie.tokens[j].item() for j in sorted(ancestors, key=lambda j: trie.depths[j].item()))


def _host_path(trie, node: int) -> list[int]:
    nodes = []
    while node > 0:
        nodes.append(node)
        node = trie.parents[node]
    return nodes[::-1]


class _Samples:
    def __init__(self, table: dict[tuple[int, ...], int]) -> None:
        self.table, self.trie = table, None

    def sample(self, node: int) -> int:
        return self.table[tuple(self.trie.tokens[n] for n in _host_path(self.trie, node))]


def test_device_walk_accepts_what_the_host_walk_accepts():
    """Samples are a function of the path (as the target's are); the device walk's emitted tokens
    equal accept_trie's on the host trie, including the stop-token and limit cuts."""
    generator = torch.Generator().manual_seed(4)
    for case in range(200):
        tree, ranked, grams, valid = _random_trie_case(generator, vocab=3)
        slots = TrieSlots(tree, ngram_topk=4, size=32, device=torch.device("cpu"))
        trie = slots.assemble(torch.tensor(0), ranked, grams, valid)
        paths = {}
        samples = []
        for slot in range(32):
            key = _device_path(trie, slot)
            paths.setdefault(key, int(torch.randint(0, 3, (1,), generator=generator)))
            samples.append(paths[key])
        remaining = 2 + case % 4
        stops = frozenset({case % 5}) if case % 3 == 0 else frozenset()
        result = walk(trie, torch.tensor(samples), torch.tensor(remaining), torch.tensor(sorted(stops)), 3)
        host = build_trie(
            0,
            tree,
            ranked.tolist(),
            [[0] + g for g, v in zip(grams.tolist(), valid.tolist()) if v],
            ngrams_from_root=True,
        )
        targets = _Samples(paths)
        targets.trie = host
        expected = accept_trie(host, targets, remaining, stops)
        count = int(result.count)
        assert result.emitted[:count].tolist() == expected.tokens
        stopped = expected.tokens[-1] in stops or len(expected.tokens) >= remaining
        assert bool(result.stopped) == stopped


def test_device_loop_with_the_compiled_cpu_sampler(llama_dir):
    """float32 on a CPU samples through the compiled sampler (FusedSampler) with per-slot windows."""
    engine = quiet_load(llama_dir[0])
    prompt = _prompt(engine.config.vocab_size)
    base = dict(max_new_tokens=100, sampling=PAPER_SAMPLING, seed=7, ignore_eos=True)
    ar, _ = generate(engine, prompt, GenerationConfig(**base, method="ar"))
    device, _ = generate(engine, prompt, GenerationConfig(**base, tree="3,3,3", device_loop=True))
    assert device == ar


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU and a CUDA build of torch"
)
@pytest.mark.parametrize("sampling", [GREEDY, PAPER_SAMPLING], ids=["greedy", "sampling"])
def test_device_loop_is_one_graph_replayed_every_iteration_on_cuda(llama_dir, sampling):
    engine = quiet_load(llama_dir[0], dtype=torch.float64, device="cuda")  # float64: no near-ties
    prompt = _prompt(engine.config.vocab_size)
    base = dict(max_new_tokens=160, sampling=sampling, seed=3, ignore_eos=True)
    ar, _ = generate(engine, prompt, GenerationConfig(**base, method="ar"))
    device, stats = generate(engine, prompt, GenerationConfig(**base, tree="3,3,3", device_loop=True))
    assert device == ar
    assert stats.graph_captures == 1
    assert stats.graph_replays == stats.iterations + 1  # the one queued after the last is a no-op
