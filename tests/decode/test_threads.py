"""The CPU thread count: the CPUs a process may use (affinity, cgroup quota), the governor that moves
between thread counts by measured speed, and tokens that do not depend on the count."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from tokenswift_trt.cli import main
from tokenswift_trt.decode import loop as loop_module
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.threads import (
    ThreadGovernor,
    candidate_counts,
    cgroup_cpu_limit,
    thread_setting,
    usable_cpus,
)
from tokenswift_trt.kernels.config import KernelConfig, KernelConfigError
from tokenswift_trt.model.sampling import SamplingConfig

PAPER_SAMPLING = SamplingConfig(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=16)


def test_the_cgroup_quota_caps_the_usable_cpus(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None and usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: one thread
    assert cgroup_cpu_limit(tmp_path) == 1.5 and usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # cgroup v1, no quota
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == 1


def test_thread_settings_and_candidates():
    assert candidate_counts(8) == (8, 4, 2, 1) and candidate_counts(3) == (3, 1)
    assert thread_setting("auto") is None and thread_setting("3") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="auto or a positive"):
            thread_setting(bad)
        with pytest.raises(KernelConfigError, match="threads is auto or a positive"):
            KernelConfig().updated({"threads": bad})
    assert KernelConfig().updated({"threads": 2}).threads == "2"  # an int from Python
    assert ThreadGovernor.for_setting("3").counts == (3,)


class FakeLoad:
    """Other processes' CPU use as the test says it is."""

    def __init__(self) -> None:
        self.busy = 0.0

    def others(self) -> float:
        return self.busy

    def steady(self) -> float:
        return self.busy


def _simulate(governor: ThreadGovernor, load: FakeLoad, phases: list[tuple[float, int]]) -> list[int]:
    """Iterations on a 2-core machine: 1 ms a token with 2 threads idle, 1.3 ms with 1 thread; beside a
    busy neighbour 1 thread still 1.3 ms, 2 threads 5 ms (the barrier waits for a descheduled thread).
    `phases`: (neighbour CPUs, iterations); returns the thread count of every iteration."""
    used = []
    for busy, iterations in phases:
        load.busy = busy
        for _ in range(iterations):
            threads = governor.threads
            used.append(threads)
            seconds = (0.005 if busy else 0.001) if threads == 2 else 0.0013
            governor.observe(seconds, 1)
    return used


def test_the_governor_keeps_every_cpu_on_an_idle_machine():
    load = FakeLoad()
    governor = ThreadGovernor((2, 1), window=16, window_s=0.0, load=load)
    used = _simulate(governor, load, [(0.0, 4000)])
    assert set(used) == {2} and governor.switches == 0  # no trial of fewer threads while nothing else runs


def test_the_governor_drops_threads_beside_a_busy_neighbour_and_takes_them_back():
    load = FakeLoad()
    governor = ThreadGovernor((2, 1), window=16, window_s=0.0, load=load)
    used = _simulate(governor, load, [(0.0, 400), (1.0, 2000), (0.0, 400)])
    busy = used[400:2400]
    assert busy[100:].count(1) / len(busy[100:]) > 0.97  # one thread within a few windows, trials aside
    after = used[2400:]
    assert after[-300:].count(2) == 300  # the neighbour gone: both threads again
    assert governor.switches >= 2


def test_the_governor_tries_fewer_threads_where_it_cannot_see_the_load():
    governor = ThreadGovernor((2, 1), window=16, window_s=0.0, load=None)
    load = FakeLoad()
    used = _simulate(governor, load, [(1.0, 2000)])
    assert used[-1000:].count(1) > 950


def test_tokens_do_not_depend_on_the_thread_count(llama_engine64, monkeypatch):
    """A governor that changes the count every few iterations commits the tokens of a fixed count."""
    prompt = torch.randint(
        3, llama_engine64.config.vocab_size, (40,), generator=torch.Generator().manual_seed(5)
    )
    prompt = prompt.tolist() * 2
    config = GenerationConfig(
        max_new_tokens=120,
        sampling=PAPER_SAMPLING,
        seed=3,
        ignore_eos=True,
        tree="3,3",
        draft_source="verify",
    )
    one = replace(llama_engine64, kernels=replace(llama_engine64.kernels, threads="1"))
    fixed, _ = generate(one, prompt, config)

    class Flipping(ThreadGovernor):
        @classmethod
        def for_setting(cls, value: str, cpus: int | None = None) -> ThreadGovernor:
            return cls((2, 1))

        def observe(self, seconds: float, tokens: int) -> None:  # a new count every other iteration
            self.switches += 1
            self.chosen = (self.chosen + 1) % len(self.counts)

    monkeypatch.setattr(loop_module, "ThreadGovernor", Flipping)
    flipping, stats = generate(replace(one, kernels=replace(one.kernels, threads="auto")), prompt, config)
    assert stats.thread_switches > 10
    assert flipping == fixed
    ar, _ = generate(one, prompt, replace(config, method="ar"))
    assert ar == fixed


def test_threads_option_names_the_fix():
    result = CliRunner().invoke(
        main, ["generate", "--model", "swift-tiny", "--prompt", "x", "--threads", "0"]
    )
    assert result.exit_code == 2
    assert "auto or a positive number of threads" in result.output
    assert "Traceback" not in result.output


def test_neighbour_load_sees_a_busy_process():
    """The real /proc: a busy loop beside us is at least one running thread of another process."""
    import subprocess
    import sys
    import time

    from tokenswift_trt.decode.threads import NeighbourLoad

    load = NeighbourLoad()
    if load.steady() is None:
        pytest.skip("no /proc here")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert load.steady() >= 1
    finally:
        busy.kill()
        busy.wait()
