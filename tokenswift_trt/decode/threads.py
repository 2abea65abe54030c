"""How many CPU threads decode with, chosen for the machine as it is now.

Two parts:

- `usable_cpus()`: the CPUs this process may run on, from its affinity mask and its cgroup's CPU quota
  (a container limited to 2 CPUs on a 64-core host gets 2), not `os.cpu_count()`.
- `ThreadGovernor`: the products and attention of a decode step run in many short parallel regions,
  each ending at a barrier that waits for its slowest thread. When another process takes one of the
  cores, the thread that shares it is descheduled for a time slice at a time and every region waits for
  it: on 2 cores with one busy neighbour, 2 threads ran a small model's AR steps 3-4x slower than 1
  thread. The governor times the generation's own iterations in windows and now and then runs one
  window at a neighbouring thread count; it keeps whichever runs more tokens per second, reacts at once
  when the current count slows down sharply, and keeps trying larger counts with a growing interval,
  so that a run that started beside a busy neighbour speeds up again once the neighbour is gone.

The thread count never changes tokens: the CPU kernels cut their work at fixed places whatever the
thread count (plugins_cuda/cpu), so the governor decides speed only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

AUTO = "auto"
CGROUP_ROOT = Path("/sys/fs/cgroup")

Yielded = TypeVar("Yielded")
Returned = TypeVar("Returned")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup quota allows (quota / period), or None where none is set or none is readable.
    cgroup v2 (`cpu.max`: "max 100000" or "200000 100000"), else v1 (`cpu.cfs_quota_us`, -1 = none)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may use: its affinity mask, capped by its cgroup's quota (rounded down,
    at least 1)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        count = min(count, max(1, int(limit)))
    return max(1, count)


class NeighbourLoad:
    """CPU time that other processes took on this process's CPUs: per-CPU busy time from /proc/stat
    minus this process's own CPU time, as CPUs busy (0.0 = none, 1.0 = one whole CPU) over the time since
    the last reading. None where /proc/stat cannot be read (not Linux)."""

    def __init__(
        self, stat: Path = Path("/proc/stat"), span_s: float = 0.25, first_span_s: float = 0.05
    ) -> None:
        self.stat, self.span_s, self.first_span_s = stat, span_s, first_span_s
        self._readings = 0
        try:
            self.cpus = {f"cpu{index}" for index in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self.cpus = set()
        self.ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        """(wall seconds, busy seconds of our CPUs, this process's CPU seconds), or None."""
        try:
            lines = self.stat.read_text().splitlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in self.cpus:
                ticks = [int(value) for value in rest.split()]
                busy += sum(ticks[:8]) - ticks[3] - ticks[4]  # all but idle and iowait (guest is in user)
        return time.perf_counter(), busy / self.ticks_per_s, time.process_time()

    def others(self) -> float | None:
        """CPUs busy with other processes since the last reading, or None where that was less than
        `span_s` ago (`first_span_s` for the first reading; /proc/stat counts in ticks of 10 ms, so
        shorter spans are mostly rounding) or where nothing can be read."""
        if self._last is None or not self.cpus:
            return None
        span = self.span_s if self._readings else self.first_span_s  # decide early, then steadily
        if time.perf_counter() - self._last[0] < span:
            return None
        self._readings += 1
        now, last = self._read(), self._last
        self._last = now
        if now is None:
            return None
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0]))


def thread_setting(value: str) -> int | None:
    """The `threads` kernel setting -> a fixed count, or None for `auto`; ValueError names the fix."""
    if value == AUTO:
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"threads is auto or a positive number of threads, got {value!r}")
    return count


def candidate_counts(most: int) -> tuple[int, ...]:
    """Thread counts the governor moves between: `most`, then halving down to 1 (largest first)."""
    counts = [most]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return tuple(counts)


@dataclass
class ThreadGovernor:
    """Chooses the thread count of a generation from its own measured speed (see the module doc).

    `counts`: the candidate counts, largest first (one count: fixed). Time is counted in windows of
    `window` iterations and `window_s` seconds; after `explore` windows at the chosen count one window
    tries a neighbouring count (the interval doubles, up to `max_explore`, each time the trial loses; a
    trial `abandon` times slower than the chosen count stops after two iterations). A smaller count is
    tried only while other processes use our CPUs (`load`), at once where a window runs `slowdown` times
    slower than the best seen at its count; a larger one at once when they stop."""

    counts: tuple[int, ...]
    window: int = 4
    window_s: float = 0.05  # and at least this long: a few scheduler time slices
    explore: int = 1
    max_explore: int = 128
    slowdown: float = 1.5
    margin: float = 0.9  # a trial count is kept when its seconds per token are below this share
    abandon: float = 2.0  # a trial running this many times slower than the chosen count stops early
    # fewer threads are tried only while other processes keep this many of our CPUs busy (where
    # `load` can tell; everywhere otherwise), more threads as soon as they do not
    neighbour_cpus: float = 0.5
    load: NeighbourLoad | None = None
    chosen: int = 0  # index into counts
    trial: int | None = None  # index of the count the current window tries
    switches: int = 0
    _interval: int = 0
    _since_trial: int = 0
    _iterations: int = 0
    _seconds: float = 0.0
    _tokens: int = 0
    _recent: dict[int, float] = field(default_factory=dict)  # index -> seconds/token, last window
    _best: dict[int, float] = field(default_factory=dict)  # index -> best seconds/token seen
    _tried_up: bool = False  # the last trial went to a larger count
    _busy: bool | None = None  # other processes use our CPUs (None: not known here)

    @classmethod
    def for_setting(cls, value: str, cpus: int | None = None) -> ThreadGovernor:
        """`auto`: every count from the usable CPUs down to 1; a number: that count, fixed."""
        fixed = thread_setting(value)
        if fixed is not None:
            return cls((fixed,))
        return cls(candidate_counts(cpus if cpus is not None else usable_cpus()), load=NeighbourLoad())

    def __post_init__(self) -> None:
        self._interval = self.explore
        if self.load is not None:
            self._busy = False  # until a reading says otherwise

    @property
    def threads(self) -> int:
        """The count the next iteration runs with."""
        return self.counts[self.trial if self.trial is not None else self.chosen]

    def apply(self) -> None:
        """Set PyTorch's (and so the CPU kernels') thread count to `threads` where it differs."""
        import torch  # here: the serving front imports `usable_cpus` without loading torch

        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def observe(self, seconds: float, tokens: int) -> None:
        """One iteration took `seconds` and committed `tokens`."""
        if len(self.counts) == 1:
            return
        self._iterations += 1
        self._seconds += seconds
        self._tokens += tokens
        if self.trial is not None and self._iterations >= 2 and self.chosen in self._recent:
            if self._seconds > self.abandon * self._recent[self.chosen] * self._tokens:
                self._end_trial(self.trial, None)  # clearly slower already: no need to finish the window
                return
        if self._iterations < self.window or self._seconds < self.window_s:
            return
        rate = self._seconds / max(1, self._tokens)  # seconds per token
        self._iterations, self._seconds, self._tokens = 0, 0.0, 0
        if self.trial is not None:
            self._end_trial(self.trial, rate)
            return
        index = self.chosen
        self._recent[index] = rate
        best = self._best.get(index)
        self._best[index] = rate if best is None else min(best, rate)
        self._since_trial += 1
        if self.load is not None:  # the last reading holds until the next (every `span_s` or so)
            others = self.load.others()
            if others is not None:
                self._busy = others >= self.neighbour_cpus
        busy = self._busy
        up = index - 1 if index > 0 else None
        down = index + 1 if index + 1 < len(self.counts) and busy is not False else None
        if best is not None and rate > self.slowdown * best and down is not None:
            self._start_trial(down, up=False)  # the machine got busier: fewer threads at once
        elif up is not None and busy is False:
            self._start_trial(up, up=True)  # the neighbour is gone: more threads may pay again
        elif self._since_trial >= self._interval and (up is not None or down is not None):
            if up is not None and (down is None or not self._tried_up):
                self._start_trial(up, up=True)
            else:
                assert down is not None
                self._start_trial(down, up=False)

    def _start_trial(self, index: int, up: bool) -> None:
        self.trial, self._tried_up, self._since_trial = index, up, 0

    def _end_trial(self, index: int, rate: float | None) -> None:
        """The trial of counts[index] ends with its seconds per token (None: abandoned as slower)."""
        self.trial = None
        self._iterations, self._seconds, self._tokens = 0, 0.0, 0
        if rate is not None:
            best = self._best.get(index)
            self._best[index] = rate if best is None else min(best, rate)
            self._recent[index] = rate
        if rate is not None and rate < self.margin * self._recent[self.chosen]:
            self.chosen, self._interval = index, self.explore
            self.switches += 1
        else:
            self._interval = min(self.max_explore, 2 * self._interval)

    def run(self, steps: Generator[Yielded, None, Returned], tokens_of) -> Generator[Yielded, None, Returned]:
        """`steps` with the thread count applied before each resume and each iteration timed (its own
        work only, not the caller's between yields); `tokens_of(yielded)` -> tokens committed so far."""
        done_before = None
        while True:
            self.apply()
            tick = time.perf_counter()
            try:
                item = next(steps)
            except StopIteration as finished:
                return finished.value
            seconds = time.perf_counter() - tick
            done = tokens_of(item)
            if done_before is not None:
                self.observe(seconds, max(1, done - done_before))
            done_before = done
            yield item
