"""The device-resident iteration (device_loop.py), run eagerly on the CPU: its tokens equal AR's and the
host loop's, an iteration reads no host value, its noise is the host's. The stages' two forms and the
two executors are compared in test_executors.py, the n-gram table's in test_ngram.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.device_loop import DeviceLoop
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model import sampling
from tokenswift_trt.model.sampling import PositionKeyedRandom, SamplingConfig, position_gumbel_tensor

from conftest import quiet_load

GREEDY = SamplingConfig(temperature=0)
PAPER_SAMPLING = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16)
ETA_SAMPLING = SamplingConfig(temperature=1.0, eta=0.02, penalty=1.2, penalty_window=16)


def _prompt(vocab: int, length: int = 48) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.mark.parametrize(
    "sampling", [GREEDY, PAPER_SAMPLING, ETA_SAMPLING], ids=["greedy", "sampling", "eta"]
)
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
    slots = 40 + 20 * 3 + 32  # tree 3,3,3, 20 n-gram branches, a long match's (no bucket on the CPU)
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
    `torch.tensor(...)`), and reads of a tensor's value back to Python (`.item()`, `float(x)`). On a
    GPU the first is a copy from ordinary host memory and the second a sync, both of which a CUDA
    graph capture refuses; a fill with a Python value (`fill_.Scalar`) is a kernel argument instead."""

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
        elif func.overloadpacket.__name__ == "_local_scalar_dense":
            self.found.append(str(func))
        else:  # every tensor the op reads, nested in lists (cat, index_put_'s indices) or keywords too
            inputs = tree_flatten((args, kwargs))[0]
            if any(a is t for a in inputs for t in self.fresh):
                self.found.append(str(func))
        return out


@pytest.mark.parametrize(
    "kernel, sampling",
    [("default", PAPER_SAMPLING), ("flash_cascade", PAPER_SAMPLING), ("default", ETA_SAMPLING)],
    ids=["default", "flash_cascade", "eta"],
)
def test_device_loop_iteration_copies_no_host_values(llama_engine64, monkeypatch, kernel, sampling):
    """What CUDA graph capture needs, checked on the CPU: no operation of an iteration reads a
    tensor made from host data (on a GPU such a read makes the walk see `matched[0] = True`) or reads
    a value back; the FlashAttention cascade's verify included (its key ranges come from the
    device-side length), and η sampling (its threshold from each row's entropy, on the device)."""
    if kernel != "default":  # the shared engine gets its kernel back after the test
        monkeypatch.setattr(llama_engine64.model, "attention_kernel", kernel)
    recorder = HostValueCopies()
    step = DeviceLoop.step

    def recorded_step(self, plan, route: bool | None = None) -> None:
        with recorder:
            step(self, plan, route)

    monkeypatch.setattr(DeviceLoop, "step", recorded_step)
    prompt = _prompt(llama_engine64.config.vocab_size)
    config = GenerationConfig(
        max_new_tokens=24,
        sampling=sampling,
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


@pytest.mark.parametrize("tree", ["3,3,3", "auto"])
def test_device_loop_refuses_partial_cache_drafting(llama_engine64, tree):
    config = GenerationConfig(max_new_tokens=8, device_loop=True, tree=tree, draft_source="partial")
    with pytest.raises(GenerationError, match="verify pass.*host loop"):
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
@pytest.mark.parametrize(
    "sampling", [GREEDY, PAPER_SAMPLING, ETA_SAMPLING], ids=["greedy", "sampling", "eta"]
)
def test_device_loop_is_one_graph_replayed_every_iteration_on_cuda(llama_dir, sampling):
    engine = quiet_load(llama_dir[0], dtype=torch.float64, device="cuda")  # float64: no near-ties
    prompt = _prompt(engine.config.vocab_size)
    base = dict(max_new_tokens=160, sampling=sampling, seed=3, ignore_eos=True)
    ar, _ = generate(engine, prompt, GenerationConfig(**base, method="ar"))
    device, stats = generate(engine, prompt, GenerationConfig(**base, tree="3,3,3", device_loop=True))
    assert device == ar
    assert stats.graph_captures == 1
    assert stats.graph_replays == stats.iterations + 1  # the one queued after the last is a no-op
