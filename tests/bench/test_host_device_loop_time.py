"""`bench.host`'s library calls under `bench-host`: the device loop's host and wait time per iteration
from the generation's own phases, the phases per iteration, and the refusal of compiled steps."""

from __future__ import annotations

import pytest

from tokenswift_trt.bench.host import device_loop_host_time, measure_host_overhead
from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate

from conftest import quiet_load


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return quiet_load(write_random_model(tmp_path_factory.mktemp("random-tiny"), seed=4))


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


def test_phases_per_iteration_and_compiled_steps_refused(engine):
    config = GenerationConfig(tree="1,3,3,3", max_new_tokens=30, seed=1, ignore_eos=True)
    result = measure_host_overhead(engine, list(range(5, 40)), config, count_ops=False)
    for name, ms in result.phase_ms_per_iteration.items():
        assert ms == pytest.approx(result.phase_s[name] / result.iterations * 1e3)
    with pytest.raises(ValueError, match="--compile-steps with --device-loop"):
        measure_host_overhead(engine, [5, 6, 7], GenerationConfig(max_new_tokens=8, compile_steps=True))
