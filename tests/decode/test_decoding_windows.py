"""Figures by output position (`Stats.windows`): each window's counts add up to the totals, the windows
cover every generated position, and counting them changes no token, on every executor."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.stats import Stats
from tokenswift_trt.decode.text import TextCodec
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
WINDOW = 16
GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def swift_tiny():
    if not (MODEL / "model.safetensors").is_file():
        pytest.skip("models/swift-tiny is not in this checkout")
    engine = load_engine(MODEL)
    return engine, TextCodec.from_dir(MODEL).encode((MODEL / "prompt.txt").read_text())[-64:]


def _generate_watching(engine, prompt, config) -> tuple[list[int], Stats, list[tuple[int, int]]]:
    """generate with a 16-token window, noting each iteration's (first position, tokens committed)."""
    iterations: list[tuple[int, int]] = []
    seen = {"new_tokens": 1}  # the prefill's token, position 0

    def observe(stats: Stats) -> None:
        iterations.append((seen["new_tokens"], stats.new_tokens - seen["new_tokens"]))
        seen["new_tokens"] = stats.new_tokens

    tokens, stats = generate(engine, prompt, config, observer=observe, window_tokens=WINDOW)
    return tokens, stats, iterations


def _check_windows_add_up(stats: Stats, iterations: list[tuple[int, int]]) -> None:
    windows = stats.windows
    # totals: every count of every window adds up to the run's
    assert sum(w.iterations for w in windows) == stats.iterations == len(iterations)
    assert sum(w.tokens for w in windows) == stats.new_tokens - 1  # all but the prefill's token
    assert sum(w.drafted_tokens for w in windows) == stats.drafted_tokens
    assert sum(w.accepted_tokens for w in windows) == stats.accepted_tokens
    assert sum(w.ngram_accepted_tokens for w in windows) == stats.ngram_accepted_tokens
    depth = len(stats.reached_by_depth)
    for name in ("reached_by_depth", "accepted_by_depth"):
        per_window = [getattr(w, name) + [0] * (depth - len(getattr(w, name))) for w in windows]
        assert [sum(column) for column in zip(*per_window)] == getattr(stats, name)
    # coverage: consecutive windows from position 0, each holding the iterations that began in it
    assert [(w.start, w.size) for w in windows] == [(k * WINDOW, WINDOW) for k in range(len(windows))]
    expected: dict[int, list[int]] = {}
    for first, committed in iterations:
        expected.setdefault(first // WINDOW, []).append(committed)
    assert len(windows) == max(expected) + 1 == (iterations[-1][0] // WINDOW) + 1
    for index, window in enumerate(windows):
        assert window.iterations == len(expected.get(index, []))
        assert window.tokens == sum(expected.get(index, []))
    figures = stats.window_figures
    assert [f["start"] for f in figures] == [w.start for w in windows]
    for figure, window in zip(figures, windows):
        assert figure["tokens_per_iteration"] == pytest.approx(window.tokens / window.iterations)


@pytest.mark.parametrize(
    "executor",
    [
        dict(draft_source="partial"),
        dict(draft_source="verify"),
        dict(draft_source="verify", device_loop=True),
    ],
    ids=["host-partial", "host-verify", "device-loop"],
)
def test_windows_add_up_to_the_totals_and_leave_greedy_output_unchanged(swift_tiny, executor):
    engine, prompt = swift_tiny
    base = dict(max_new_tokens=64, sampling=GREEDY, ignore_eos=True, kv_budget=64, seed=0)
    ar, _ = generate(engine, prompt, GenerationConfig(**base, method="ar"))
    config = GenerationConfig(**base, tree="3,3", ngram_topk=4, **executor)
    tokens, stats, iterations = _generate_watching(engine, prompt, config)
    assert tokens == ar
    assert stats.accepted_tokens > 0 and stats.iterations < len(tokens) - 1  # drafts were accepted
    _check_windows_add_up(stats, iterations)
    # where drafts are accepted, an iteration commits more than one token in some window
    assert max(f["tokens_per_iteration"] for f in stats.window_figures) > 1
    assert all(len(f["alpha_by_depth"]) >= 2 for f in stats.window_figures)  # the tree, maybe n-grams deeper


def test_ar_windows_count_one_token_per_iteration(swift_tiny):
    engine, prompt = swift_tiny
    config = GenerationConfig(max_new_tokens=50, method="ar", sampling=GREEDY, ignore_eos=True)
    tokens, stats, iterations = _generate_watching(engine, prompt, config)
    _check_windows_add_up(stats, iterations)
    figures = stats.window_figures
    # positions 1..49 by iterations: 15 in the first window (position 0 is the prefill's), then 16s
    assert [f["iterations"] for f in figures] == [15, 16, 16, 2]
    assert all(f["tokens_per_iteration"] == 1.0 and f["drafted_tokens"] == 0 for f in figures)
    assert all(f["alpha_by_depth"] == [] for f in figures)


def test_the_default_window_is_256_positions_and_a_bad_one_is_refused(swift_tiny):
    engine, prompt = swift_tiny
    config = GenerationConfig(max_new_tokens=20, method="ar", sampling=GREEDY, ignore_eos=True)
    _, stats = generate(engine, prompt, config)
    assert [(w.start, w.size, w.iterations) for w in stats.windows] == [(0, 256, 19)]
    with pytest.raises(GenerationError, match="window must be at least 1 token"):
        generate(engine, prompt, config, window_tokens=0)
