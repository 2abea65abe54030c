"""Host time per iteration (bench/host.py, tools/bench_host.py): the timing proxy changes nothing, the
split adds up, host operations are counted outside model calls, and the device loop reports its own
host and wait time."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tokenswift_trt.bench.host import TimedModel, measure_host_overhead
from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.sampling import SamplingConfig
from tools.bench_host import HostOpCounter, count_host_ops, device_loop_host_time, main

from conftest import quiet_load
from helpers import PAPER_TREE


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return quiet_load(write_random_model(tmp_path_factory.mktemp("random-tiny"), seed=4))


def test_timed_engine_generates_the_same_tokens(engine):
    config = GenerationConfig(
        tree=PAPER_TREE,
        max_new_tokens=40,
        sampling=SamplingConfig(min_p=0.1, penalty=1.2, penalty_window=16),
        seed=3,
        ignore_eos=True,
    )
    prompt = list(range(5, 40))
    plain, _ = generate(engine, prompt, config)
    timed = TimedModel(engine.model, engine.device)
    again, _ = generate(replace(engine, model=timed), prompt, config)
    assert again == plain
    assert timed.calls > 0 and timed.seconds > 0


def test_timed_engine_runs_every_forward_where_the_timer_sees_it(engine):
    """With fixed-shape steps on (the default on CUDA), forwards would go straight to the torch
    model and the H100's host figure would hold every verify and draft (21 ms instead of ~4)."""
    config = GenerationConfig(tree=PAPER_TREE, max_new_tokens=24, seed=1, ignore_eos=True, static_steps=True)
    _, plain = generate(engine, list(range(5, 40)), config)
    timed = TimedModel(engine.model, engine.device)
    _, stats = generate(replace(engine, model=timed), list(range(5, 40)), config)
    assert plain.fixed_shape_steps > 0  # untimed, the engine takes the fixed-shape path
    assert stats.fixed_shape_steps == 0 and timed.calls >= stats.forwards > 0


def test_host_overhead_splits_decode_time(engine):
    config = GenerationConfig(tree=PAPER_TREE, max_new_tokens=60, seed=1, ignore_eos=True)
    result = measure_host_overhead(engine, list(range(5, 40)), config)
    assert result.iterations >= 2 and result.new_tokens == 60
    assert 0 < result.model_s < result.decode_s
    assert result.host_ms_per_iteration == pytest.approx(
        (result.decode_s - result.model_s) / result.iterations * 1e3
    )
    assert set(result.phase_s) >= {"draft", "trie", "verify", "accept", "commit"}
    host_ops = count_host_ops(engine, list(range(5, 40)), replace(config, seed=result.seed))
    assert 10 < host_ops / result.iterations < 1000


def test_op_counter_counts_host_operations_only(engine):
    timed = TimedModel(engine.model, engine.device)
    counter = HostOpCounter(timed)
    x, hidden = torch.ones(4), torch.zeros(1, engine.config.hidden_size)
    with torch.inference_mode(), counter:
        x + 1  # not counting yet
        counter.counting = True
        y = x * 2  # counted
        y.view(2, 2)[0]  # views launch nothing
        timed.logits(hidden)  # inside a model call
        y.sum()  # counted
    assert counter.ops == 2


def test_bench_host_command(tmp_path):
    from click.testing import CliRunner

    model = write_random_model(tmp_path / "model", seed=2)
    text = tmp_path / "prompt.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    result = CliRunner().invoke(
        main,
        [
            "--model-dir",
            str(model),
            "--prompt-file",
            str(text),
            "--prefix-len",
            "32",
            "--max-new-tokens",
            "40",
            "--ignore-eos",
            "--tree",
            "2,1",  # a fixed tree: under auto a short request on a CPU may run AR steps only
        ],
    )
    assert result.exit_code == 0, result.output
    assert "host ms/iteration:" in result.output and "verify" in result.output
    assert "host tensor ops/iteration:" in result.output
    result = CliRunner().invoke(
        main, ["--model-dir", str(model), "--prompt-file", str(text), "--max-new-tokens", "1"]
    )
    assert result.exit_code == 2 and "--max-new-tokens >= 2" in result.output


def test_the_device_loop_reports_its_host_time_per_iteration(engine):
    prompt = list(range(5, 40))
    config = GenerationConfig(
        max_new_tokens=40, seed=1, ignore_eos=True, tree="3,3,3", draft_source="verify", device_loop=True
    )
    loop = device_loop_host_time(engine, prompt, config)
    tokens, stats = generate(engine, prompt, config)  # the same request: the same iterations
    assert loop.tokens == len(tokens) == 40 and loop.iterations == stats.iterations > 0
    assert (loop.tree, loop.ngram_topk) == ("3,3,3", config.ngram_topk)
    assert loop.mean_accept_length == pytest.approx(stats.mean_accept_length)
    assert loop.host_ms_per_iteration > 0 and loop.wait_ms_per_iteration >= 0 and loop.tokens_per_s > 0


def test_compiled_steps_are_refused(engine):
    with pytest.raises(ValueError, match="--compile-steps with --device-loop"):
        measure_host_overhead(engine, [5, 6, 7], GenerationConfig(max_new_tokens=8, compile_steps=True))
