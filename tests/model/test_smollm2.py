"""SmolLM2-135M (the embedded real model): TokenSwift's greedy tokens equal transformers' own
`generate` on the prepared model, with the committed draft layers actually drafting."""

from __future__ import annotations

import pytest

from tokenswift_trt.builder.presets import PRESETS, PresetError, local_model_dir
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig
from tools.bench_ar import load_reference


def _prepared():
    try:
        return local_model_dir(PRESETS["smollm2-135m"])
    except PresetError as error:
        pytest.skip(f"{error}")


@pytest.mark.slow
def test_greedy_tokenswift_equals_transformers_generate_for_256_tokens():
    directory, heads = _prepared()
    assert heads is not None, "the committed draft layers are part of the repository"
    engine = load_engine(directory, heads_file=heads)
    codec = TextCodec.from_dir(directory)
    prompt = codec.encode(
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be"
    )
    config = GenerationConfig(
        max_new_tokens=256,
        sampling=SamplingConfig(temperature=0),
        tree="3,1",  # a static tree: every iteration drafts and verifies (auto may pick AR steps)
        draft_source="verify",
        ignore_eos=True,
    )
    ours, stats = generate(engine, prompt, config)
    assert ours == load_reference(directory)(prompt, 256)
    assert stats.accepted_tokens > 0 and stats.iterations < 256  # the draft layers were used


@pytest.mark.slow
def test_a_schedule_is_drafted_by_substituted_matches_and_keeps_ars_tokens(monkeypatch):
    """SmolLM2 writes a schedule whose hour changes on every line: the line before, with its hour
    written as the new one (`suffix.substituted`), is offered and accepted whole, and the tokens
    stay AR's."""
    from tokenswift_trt.decode import suffix

    directory, heads = _prepared()
    engine = load_engine(directory, heads_file=heads)
    codec = TextCodec.from_dir(directory)
    prompt = codec.encode(
        "Write the town council's weekly notice for the residents of Millbrook. Each week the notice "
        "lists the road works, the bin collection days and the library opening hours.\n\nNotice, week 1:\n"
    )
    offered: list[tuple[int, list[int]]] = []  # (committed length, branch)

    def recording(history, end, depth):
        branch = substituted(history, end, depth)
        offered.append((len(history), branch))
        return branch

    substituted = suffix.substituted
    monkeypatch.setattr(suffix, "substituted", recording)
    settings = dict(max_new_tokens=240, sampling=SamplingConfig(temperature=0, penalty=1.0), ignore_eos=True)
    config = GenerationConfig(tree="1,1,1", ngram_topk=1, draft_source="verify", **settings)
    ours, stats = generate(engine, prompt, config)
    ar, _ = generate(engine, prompt, GenerationConfig(method="ar", **settings))
    assert ours == ar
    text = prompt + ours
    whole = [b for at, b in offered if len(b) >= 8 and text[at : at + len(b)] == b]
    assert len(whole) >= 3, offered  # a line's worth at a time, several times
    assert stats.iterations < len(ours) / 4


@pytest.mark.slow
def test_drafting_on_the_partial_cache_conditions_the_layers_on_the_sample_they_follow():
    """The committed layers read the root token: drafting on the partial cache (the paper's trees)
    they follow the base row's first draft as ranked with the target's noise, its own sample, and
    accept about what they do drafting from the verify pass; their tokens stay AR's."""
    directory, heads = _prepared()
    engine = load_engine(directory, heads_file=heads)
    codec = TextCodec.from_dir(directory)
    prompt = codec.encode("It was the best of times, it was the worst of times, it was the age of wisdom,")
    sampling = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=256)
    config = GenerationConfig(
        max_new_tokens=200, sampling=sampling, seed=0, tree="1,3,3,3", draft_source="partial", ignore_eos=True
    )
    ours, stats = generate(engine, prompt, config)
    ar, _ = generate(
        engine,
        prompt,
        GenerationConfig(max_new_tokens=200, sampling=sampling, seed=0, method="ar", ignore_eos=True),
    )
    assert ours == ar
    # depth 1 is the base row's draft; depth 2 layer 1's: about 0.26 when it followed the base's most
    # likely token instead of the sample, about 0.45-0.5 now
    assert stats.acceptance_by_depth[1] > 0.35, stats.acceptance_by_depth
