"""Draft layers adapted online (model/draft_adaptation.py): output equals AR's, every request adapts
its own copy (the engine's layers and other requests untouched), the step trains against the target's
processed distribution, layers with a draft vocabulary draft the request's own tokens too, and the
device loop adapts as the host loop does, from the hidden states it keeps on the device."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.loop import decode_steps, generate
from tokenswift_trt.decode.state import engine_adapter, new_adapter, new_decode_state
from tokenswift_trt.model import draft_adaptation
from tokenswift_trt.model.draft_adaptation import AdaptationSettings, DraftAdapter
from tokenswift_trt.model.sampling import PositionKeyedRandom, SamplingConfig, process_logits

GREEDY = SamplingConfig(temperature=0)
PAPER = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16)


def _prompt(vocab: int, length: int = 40, seed: int = 5) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _state(layers) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in layers.state_dict().items()}


@pytest.mark.parametrize("sampling", [GREEDY, PAPER], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    "plan",
    [dict(tree="3,3", draft_source="verify"), dict(tree="1,3,3", draft_source="partial"), dict(tree="auto")],
    ids=["verify", "partial", "auto"],
)
@pytest.mark.parametrize("engine_name", ["llama_engine64", "rooted_engine64", "vocab_engine64"])
def test_adapted_drafts_emit_ars_tokens(request, engine_name, plan, sampling):
    engine = request.getfixturevalue(engine_name)
    prompt = _prompt(engine.config.vocab_size)
    base = GenerationConfig(max_new_tokens=160, sampling=sampling, seed=7, ignore_eos=True, **plan)
    before = _state(engine.draft_layers)
    adapted, stats = generate(engine, prompt, replace(base, adapt_drafts=True, adapt_block=8))
    ar, _ = generate(engine, prompt, replace(base, method="ar"))
    assert adapted == ar
    if plan["tree"] != "auto":  # the tuner may settle on AR steps, which adapt nothing
        assert stats.draft_updates > 0 and stats.phase_s["adapt"] > 0
    after = engine.draft_layers.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # the engine's layers unchanged


def test_a_request_never_sees_another_requests_adaptation(rooted_engine64):
    engine = rooted_engine64
    config = GenerationConfig(
        max_new_tokens=96,
        sampling=PAPER,
        seed=3,
        ignore_eos=True,
        tree="3,3",
        draft_source="verify",
        adapt_drafts=True,
        adapt_block=4,
        adapt_lr=0.05,  # large steps: B's drafts visibly change, and so would A's leaking into B
    )
    prompt_b = _prompt(engine.config.vocab_size, seed=9)
    first_b = generate(engine, prompt_b, config)[1]
    generate(engine, _prompt(engine.config.vocab_size, seed=1), replace(config, max_new_tokens=256))
    second_b = generate(engine, prompt_b, config)[1]
    # adapting changed request B's drafts (else this test would prove nothing) ...
    static_b = generate(engine, prompt_b, replace(config, adapt_drafts=False))[1]
    assert first_b.accepted_by_depth != static_b.accepted_by_depth
    # ... and request B after request A drafts exactly as before it: A's adaptation stayed A's
    assert (second_b.accepted_by_depth, second_b.reached_by_depth) == (
        first_b.accepted_by_depth,
        first_b.reached_by_depth,
    )


def test_each_request_drafts_with_its_own_copy(rooted_engine64):
    engine = rooted_engine64
    config = GenerationConfig(max_new_tokens=32, sampling=PAPER, seed=1, adapt_drafts=True)
    prompt = _prompt(engine.config.vocab_size)
    adapters = [
        new_adapter(engine, new_decode_state(engine, prompt, config, PositionKeyedRandom(1)), config)
        for _ in range(2)
    ]
    first, second = (dict(adapter.layers.named_parameters()) for adapter in adapters)
    shared = dict(engine.draft_layers.named_parameters())
    for name, parameter in first.items():
        assert torch.equal(parameter, shared[name])
        assert parameter.data_ptr() not in (shared[name].data_ptr(), second[name].data_ptr())


def _block(engine, config, length: int = 48):
    """A request's state with `length` committed tokens and their hidden states [length, hidden]."""
    tokens = _prompt(engine.config.vocab_size, length)
    state = new_decode_state(engine, tokens, config, PositionKeyedRandom(1))
    with torch.inference_mode():
        hidden = engine.model(
            torch.tensor(tokens, device=engine.device),
            torch.arange(length, device=engine.device),
            state.full,
            keep_queries=False,
        ).hidden  # [length, hidden]
    return state, hidden


def test_the_teacher_is_what_sampling_draws_from(llama_engine64):
    """Without a draft vocabulary, the step's target at a position is the processed distribution AR
    samples from there: the penalty over that position's own window, then min-p."""
    engine, config = llama_engine64, GenerationConfig(max_new_tokens=8, sampling=PAPER, adapt_drafts=True)
    state, hidden = _block(engine, config)
    adapter = new_adapter(engine, state, config)
    positions = torch.arange(20, 40)
    windows = adapter._windows(positions, 39)
    teacher = adapter._teacher(hidden[20:40], windows, state.history[21:41])
    for row, position in enumerate(positions.tolist()):
        with torch.inference_mode():
            logits = engine.model.logits(hidden[position][None])  # [1, V]
        window = state.history[max(0, position + 1 - PAPER.penalty_window) : position + 1]
        expected = torch.softmax(process_logits(logits, window, PAPER).float(), dim=-1)[0]
        torch.testing.assert_close(teacher[row], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "settings", [AdaptationSettings(), AdaptationSettings(scope="layer1", optimizer="sgd")]
)
def test_steps_on_a_block_bring_the_drafts_towards_the_target(rooted_engine64, settings):
    """Steps on the same committed positions lower the draft layers' loss there (the "sampled" loss)."""
    engine = rooted_engine64
    config = GenerationConfig(
        max_new_tokens=8,
        sampling=PAPER,
        adapt_drafts=True,
        adapt_block=40,
        adapt_scope=settings.scope,
        adapt_optimizer=settings.optimizer,
    )
    state, hidden = _block(engine, config)
    adapter = new_adapter(engine, state, config)

    def loss() -> float:
        rows, roots = hidden[:40], state.history[1:41]
        with torch.inference_mode():
            teacher = adapter._teacher(rows[1:], adapter._windows(torch.arange(1, 40), 39), roots[1:])
            normed = adapter.layers.chain(rows, 1, adapter.embedding[roots])[0][1]
            student = torch.log_softmax(torch.nn.functional.linear(normed.float(), adapter.rows), -1)
        return float(-(teacher * student[:-1]).sum(-1).mean())

    start = loss()
    for _ in range(5):
        adapter.positions, adapter.hidden, adapter.pending = [], [], 0
        adapter.observe(0, hidden[:40], state.history[1:41].tolist())
    assert adapter.updates == 5
    assert loss() < start - 1e-3


def test_each_step_trains_on_the_newest_span_positions(rooted_engine64, monkeypatch):
    """A step every `adapt_block` positions reads the newest `adapt_span` of them (fewer while fewer
    are committed), plus the `count` before them that deeper layers' targets reach back over."""
    engine = rooted_engine64
    config = GenerationConfig(
        max_new_tokens=8, sampling=PAPER, adapt_drafts=True, adapt_block=8, adapt_span=24
    )
    state, hidden = _block(engine, config, length=64)
    adapter = new_adapter(engine, state, config)
    steps: list[tuple[int, int, torch.Tensor]] = []  # (rows, target rows, newest row)
    monkeypatch.setattr(
        adapter, "_step", lambda rows, roots, windows, pending: steps.append((len(rows), pending, rows[-1]))
    )
    for start in range(8, 56, 8):
        adapter.observe(start, hidden[start : start + 8], state.history[start + 1 : start + 9].tolist())
    count = adapter.count
    assert count > 1  # the rooted test engine's chain of layers
    assert [(rows, targets) for rows, targets, _ in steps] == [
        (8, 8),
        (16, 16),
        (24, 24),
        (24 + count, 24),
        (24 + count, 24),
        (24 + count, 24),
    ]
    for (_, _, newest), start in zip(steps, range(8, 56, 8), strict=True):
        assert torch.equal(newest, hidden[start + 7].float())


@pytest.mark.parametrize("vocab, chunk", [("request", 512), ("request", 4), ("draft", 512)])
def test_the_request_vocabulary_drafts_the_requests_own_tokens(vocab_engine64, vocab, chunk, monkeypatch):
    """With a draft vocabulary (every third id), the adapted copy drafts the prompt's tokens outside it
    from the start and each committed one from the step after it; `draft` keeps the vocabulary. Its own
    rows fill a buffer in place and move to a larger one when it is full (a chunk of 4 rows here)."""
    monkeypatch.setattr(draft_adaptation, "OWN_CHUNK", chunk)
    engine = vocab_engine64
    config = GenerationConfig(
        max_new_tokens=8, sampling=PAPER, adapt_drafts=True, adapt_block=8, adapt_vocab=vocab
    )
    state, hidden = _block(engine, config, length=48)
    prompt = state.history[:24]
    state.tokens[24:] = []  # the request's prompt: its first 24 tokens; the rest committed later
    adapter = new_adapter(engine, state, config)
    draftable = set(engine.draft_layers.vocab.tolist())

    def drafted() -> set[int]:
        with torch.inference_mode():
            logits = engine.model.draft_logits(hidden[:4], adapter.layers, 1, state.history[1:5])[0]
        return set(torch.isfinite(logits).all(0).nonzero()[:, 0].tolist())

    outside = {token for token in prompt.tolist() if token not in draftable}
    later = {token for token in state.history[25:41].tolist() if token not in draftable} - outside
    assert outside and later  # the random prompt has tokens outside the vocabulary, before and after 24
    assert drafted() == (draftable | outside if vocab == "request" else draftable)
    for start in range(24, 40, 8):  # committed positions 24..39: their next tokens, 25..40, are committed
        adapter.observe(start, hidden[start : start + 8], state.history[start + 1 : start + 9].tolist())
    assert adapter.updates == 2
    assert drafted() == (draftable | outside | later if vocab == "request" else draftable)
    assert torch.isfinite(adapter.rows).all() and adapter.rows.shape[0] == len(drafted())
    if vocab == "request":  # replaced at the first admission, then only when full
        assert adapter.head_version == 1
        adapter.admit(range(engine.config.vocab_size))  # every id: more than twice the first ones
        assert drafted() == set(range(engine.config.vocab_size))
        assert adapter.head_version == (1 if chunk == 512 else 2)


@pytest.mark.parametrize("sampling", [GREEDY, PAPER], ids=["greedy", "sampled"])
@pytest.mark.parametrize("tree", ["3,3", "auto"])
@pytest.mark.parametrize("engine_name", ["llama_engine64", "vocab_engine64"])
def test_the_device_loop_adapts_and_emits_ars_tokens(request, engine_name, tree, sampling):
    engine = request.getfixturevalue(engine_name)
    prompt = _prompt(engine.config.vocab_size)
    base = GenerationConfig(
        max_new_tokens=160, sampling=sampling, seed=7, ignore_eos=True, tree=tree, device_loop=True
    )
    before = _state(engine.draft_layers)
    adapted, stats = generate(engine, prompt, replace(base, adapt_drafts=True, adapt_block=8))
    assert adapted == generate(engine, prompt, replace(base, method="ar"))[0]
    assert adapted == generate(engine, prompt, base)[0]
    if tree != "auto":  # the tuner may settle on AR steps, which adapt nothing
        assert stats.draft_updates > 0 and stats.phase_s["adapt"] > 0
    after = engine.draft_layers.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # the engine's layers unchanged


@pytest.mark.parametrize("device_loop", [False, True], ids=["host-loop", "device-loop"])
def test_a_generation_stopped_early_still_waits_for_its_step(llama_engine64, monkeypatch, device_loop):
    """A caller that stops iterating (a client gone, a server stopping) closes the generator: the
    adapter's last step is still awaited before the request's memory goes (`DraftAdapter.finish`)."""
    finished = []
    finish = DraftAdapter.finish
    monkeypatch.setattr(DraftAdapter, "finish", lambda adapter: finished.append(adapter) or finish(adapter))
    config = GenerationConfig(
        max_new_tokens=64,
        sampling=PAPER,
        seed=1,
        tree="3,3",
        device_loop=device_loop,
        draft_source="verify",
        adapt_drafts=True,
        adapt_block=4,
    )
    steps = decode_steps(llama_engine64, _prompt(llama_engine64.config.vocab_size), config)
    stats = [next(steps) for _ in range(6)][-1]
    assert stats.draft_updates > 0 and not finished
    steps.close()
    assert len(finished) == 1


def test_the_first_sampled_token_is_drafted_from_the_start(vocab_engine64, monkeypatch):
    """The token the prefill samples is admitted before the first iteration, as the prompt's are
    (the steps admit only the tokens after it)."""
    engine = vocab_engine64
    calls: list[tuple[str, list[int]]] = []
    admit, observe = DraftAdapter.admit, DraftAdapter.observe

    def spy_admit(adapter, tokens):
        calls.append(("admit", list(tokens)))
        return admit(adapter, tokens)

    def spy_observe(adapter, first_position, hidden, tokens):
        calls.append(("observe", list(tokens)))
        return observe(adapter, first_position, hidden, tokens)

    monkeypatch.setattr(DraftAdapter, "admit", spy_admit)
    monkeypatch.setattr(DraftAdapter, "observe", spy_observe)
    prompt = _prompt(engine.config.vocab_size, length=8)
    config = GenerationConfig(max_new_tokens=24, sampling=PAPER, seed=5, ignore_eos=True, tree="3,3")
    tokens, _ = generate(engine, prompt, replace(config, adapt_drafts=True, adapt_block=8))
    first_observe = next(index for index, (kind, _) in enumerate(calls) if kind == "observe")
    admitted = {token for kind, ids in calls[:first_observe] if kind == "admit" for token in ids}
    assert tokens[0] not in prompt  # else the prompt's admission would cover it
    assert set(prompt) | {tokens[0]} <= admitted
    assert calls[first_observe][1][0] == tokens[1]  # the steps see the tokens after it


def test_the_device_loop_follows_the_request_heads_growth(vocab_engine64, monkeypatch):
    """Own rows in chunks of 4: the adapted copy's head is replaced several times during the run (the
    device loop captures its graphs again after each, on CUDA), and the output stays AR's."""
    monkeypatch.setattr(draft_adaptation, "OWN_CHUNK", 4)
    engine = vocab_engine64
    heads = []
    empty = draft_adaptation.RequestVocabHead.empty
    monkeypatch.setattr(
        draft_adaptation.RequestVocabHead,
        "empty",
        classmethod(lambda cls, *args: heads.append(empty(*args)) or heads[-1]),
    )
    prompt = _prompt(engine.config.vocab_size, length=8)
    config = GenerationConfig(
        max_new_tokens=160, sampling=PAPER, seed=5, ignore_eos=True, tree="3,3", device_loop=True
    )
    adapted, stats = generate(engine, prompt, replace(config, adapt_drafts=True, adapt_block=8))
    assert adapted == generate(engine, prompt, replace(config, method="ar"))[0]
    assert len(heads) >= 3 and stats.draft_updates > 0
    assert heads[-1].ids.shape[0] > heads[0].ids.shape[0]


def test_the_device_loop_hands_the_adapter_every_committed_positions_state(llama_engine64, monkeypatch):
    """The device loop's kept rows: every committed position once, in order, with its next token and
    the target's hidden state there (as a plain forward over the text computes it)."""
    engine = llama_engine64
    prompt = _prompt(engine.config.vocab_size)
    seen: list[tuple[int, torch.Tensor, list[int]]] = []
    observe = DraftAdapter.observe

    def spy(adapter, first_position, hidden, tokens):
        seen.append((first_position, hidden.clone(), list(tokens)))
        return observe(adapter, first_position, hidden, tokens)

    monkeypatch.setattr(DraftAdapter, "observe", spy)
    config = GenerationConfig(
        max_new_tokens=96, sampling=PAPER, seed=3, ignore_eos=True, tree="3,3", device_loop=True
    )
    tokens, stats = generate(engine, prompt, replace(config, adapt_drafts=True, adapt_block=8))
    text = prompt + tokens
    positions = [first + row for first, hidden, _ in seen for row in range(hidden.shape[0])]
    assert positions == list(range(len(prompt), len(text) - 1))
    assert [token for _, _, after in seen for token in after] == text[len(prompt) + 1 :]
    state = new_decode_state(engine, text, config, PositionKeyedRandom(1))
    with torch.inference_mode():
        full = engine.model(
            torch.tensor(text), torch.arange(len(text)), state.full, keep_queries=False
        ).hidden  # [T, hidden]
    kept = torch.cat([hidden for _, hidden, _ in seen])
    torch.testing.assert_close(kept, full[len(prompt) : len(text) - 1], atol=1e-4, rtol=1e-4)
    assert stats.draft_updates == (len(text) - 1 - len(prompt)) // 8


def test_off_by_default_and_never_for_ar(llama_engine64):
    config = GenerationConfig(max_new_tokens=24, tree="3,3", seed=1)
    assert not config.adapts_drafts
    assert not replace(config, method="ar", adapt_drafts=True).adapts_drafts
    prompt = _prompt(llama_engine64.config.vocab_size)
    assert generate(llama_engine64, prompt, config)[1].draft_updates == 0


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(adapt_block=0), "block"),
        (dict(adapt_span=0), "span"),
        (dict(adapt_scope="norms"), "scope"),
        (dict(adapt_optimizer="lion"), "optimiser"),
        (dict(adapt_lr=2.0), "learning rate"),
        (dict(adapt_vocab="all"), "vocabulary"),
    ],
)
def test_bad_adaptation_settings_are_refused_in_one_line(bad, message):
    with pytest.raises(GenerationError, match=message):
        GenerationConfig(max_new_tokens=8, **bad).validate()


def test_adams_beta2_is_a_setting(rooted_engine64):
    """The optimiser takes its second-moment decay from the settings; one outside (0, 1) is refused."""
    engine = rooted_engine64
    config = GenerationConfig(max_new_tokens=8, sampling=PAPER, adapt_drafts=True)
    state, _ = _block(engine, config)
    adapter = engine_adapter(engine, state.history, 8, PAPER, AdaptationSettings(beta2=0.95))
    assert adapter.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    with pytest.raises(ValueError, match="beta2"):
        AdaptationSettings(beta2=1.0).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs CUDA")
@pytest.mark.parametrize("device_loop", [False, True], ids=["host-loop", "device-loop-graphs"])
def test_the_side_stream_update_keeps_ars_tokens_on_cuda(llama_dir, device_loop):
    from conftest import quiet_load

    engine = quiet_load(llama_dir[0], dtype=torch.float32, device="cuda")
    prompt = _prompt(engine.config.vocab_size)
    base = GenerationConfig(
        max_new_tokens=128, sampling=PAPER, seed=2, ignore_eos=True, tree="3,3", device_loop=device_loop
    )
    if device_loop:
        base = replace(base, draft_source="verify")
    adapted, stats = generate(engine, prompt, replace(base, adapt_drafts=True, adapt_block=8))
    assert adapted == generate(engine, prompt, replace(base, method="ar"))[0]
    assert stats.draft_updates > 0
    assert (stats.graph_replays > 0) == device_loop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs CUDA")
def test_a_step_is_drafted_with_from_the_next_steps_launch_on_cuda(llama_dir):
    """On CUDA a step trains the master copy on the side stream; the drafting copy takes its result
    only when the next step is launched, a block later (so the step overlaps a whole block of
    iterations), or when the request finishes."""
    from conftest import quiet_load

    engine = quiet_load(llama_dir[0], dtype=torch.float32, device="cuda")
    config = GenerationConfig(max_new_tokens=8, sampling=PAPER, adapt_drafts=True, adapt_block=8)
    state, hidden = _block(engine, config, length=32)
    adapter = new_adapter(engine, state, config)
    assert adapter.master is not adapter.layers
    tokens = lambda start: state.history[start + 1 : start + 9].tolist()  # noqa: E731
    drafting = _state(adapter.layers)
    adapter.observe(0, hidden[0:8], tokens(0))  # the first step, launched
    torch.cuda.synchronize()
    first = _state(adapter.master)
    assert any(not torch.equal(first[name], drafting[name]) for name in first)
    assert all(torch.equal(value, drafting[name]) for name, value in _state(adapter.layers).items())
    assert adapter.in_flight is not None
    adapter.observe(8, hidden[8:12], tokens(8)[:4])  # half a block: no step, nothing published
    torch.cuda.synchronize()
    assert all(torch.equal(value, drafting[name]) for name, value in _state(adapter.layers).items())
    adapter.observe(12, hidden[12:16], tokens(12)[:4])  # the second step: the first drafts from now on
    torch.cuda.synchronize()
    assert adapter.in_flight is not None
    assert all(torch.equal(value, first[name]) for name, value in _state(adapter.layers).items())
    adapter.finish()  # the second's result
    torch.cuda.synchronize()
    second = _state(adapter.master)
    assert any(not torch.equal(second[name], first[name]) for name in second)
    assert all(torch.equal(value, second[name]) for name, value in _state(adapter.layers).items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_graphs_are_captured_again_as_the_request_head_grows_on_cuda(
    llama_dir, tmp_path_factory, monkeypatch
):
    """Draft layers with a draft vocabulary, own rows in chunks of 4: the device loop's graphs are
    captured again over each larger head (into a fresh memory pool), and the output stays AR's."""
    from conftest import quiet_load, random_heads_file

    monkeypatch.setattr(draft_adaptation, "OWN_CHUNK", 4)
    heads = random_heads_file(llama_dir, tmp_path_factory, vocab_size=32)
    engine = quiet_load(llama_dir[0], dtype=torch.float32, device="cuda", heads_file=heads)
    prompt = _prompt(engine.config.vocab_size, length=8)
    base = GenerationConfig(
        max_new_tokens=160, sampling=PAPER, seed=5, ignore_eos=True, tree="3,3", device_loop=True
    )
    adapted, stats = generate(engine, prompt, replace(base, adapt_drafts=True, adapt_block=8))
    assert adapted == generate(engine, prompt, replace(base, method="ar"))[0]
    static = generate(engine, prompt, base)[1]
    assert stats.draft_updates > 0 and stats.graph_captures > static.graph_captures


def test_steps_per_block_and_the_warmup_are_settings(rooted_engine64):
    """Each block takes `steps` optimiser steps; the learning rate rises over the first `warmup`
    blocks to its full value; settings outside their range are refused."""
    engine = rooted_engine64
    config = GenerationConfig(max_new_tokens=8, sampling=PAPER, adapt_drafts=True)
    state, hidden = _block(engine, config, length=48)
    settings = AdaptationSettings(block=8, steps=3, warmup=4)
    adapter = engine_adapter(engine, state.history, 8, PAPER, settings)
    rates = []
    for start in range(8, 40, 8):
        adapter.observe(start, hidden[start : start + 8], state.history[start + 1 : start + 9].tolist())
        rates.append(adapter.optimizer.param_groups[0]["lr"])
    assert adapter.updates == 4
    first = adapter.optimizer.param_groups[0]["params"][0]
    assert adapter.optimizer.state[first]["step"] == 12  # 3 steps for each of 4 blocks
    lr = settings.learning_rate
    assert rates == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr])
    with pytest.raises(ValueError, match="at least 1 step"):
        AdaptationSettings(steps=0).validate()
    with pytest.raises(ValueError, match="warmup"):
        AdaptationSettings(warmup=-1).validate()
