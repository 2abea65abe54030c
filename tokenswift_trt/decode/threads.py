"""How many CPU threads decode with, chosen for the machine as it is now.

Two parts:

- `usable_cpus()`: the CPUs this process may run on, from its affinity mask and its cgroup's CPU quota
  (a container limited to 2 CPUs on a 64-core host gets 2), not `os.cpu_count()`.
- `ThreadGovernor`: the products and attention of a decode step run in many short parallel regions,
  each ending at a barrier that waits for its slowest thread. When another process takes one of the
  cores, the thread that shares it is descheduled for a time slice at a time and every region waits for
  it, so beside a busy neighbour fewer threads can be several times faster than more
  (docs/bench/cpu-threads-contention). The governor times the generation's own iterations in windows
  and watches how many threads other processes run (`NeighbourLoad`); while they run, it tries fewer
  threads and keeps them if they are faster; once they stop, it tries more again, so that a run that
  started beside a busy neighbour speeds up when the neighbour is gone.

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
    """How many threads of other processes are running now: the kernel's count of runnable threads
    (/proc/stat `procs_running`) less this process's own running threads (/proc/self/task), averaged
    over the readings (the newest weighs `weight`: a daemon seen once is not a neighbour). None where
    /proc cannot be read (not Linux)."""

    def __init__(self, proc: Path = Path("/proc"), weight: float = 0.3) -> None:
        self.proc, self.weight = proc, weight  # weight: of each new reading in the running average
        self._mean: float | None = None

    def _running_tasks(self) -> set[str]:
        """This process's threads that are running or runnable now."""
        running = set()
        for task in (self.proc / "self" / "task").iterdir():
            try:
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # a thread that ended meanwhile
            if state == "R":
                running.add(task.name)
        return running

    def _sample(self) -> int | None:
        try:
            before = self._running_tasks()
            running = next(
                int(line.split()[1])
                for line in (self.proc / "stat").read_text().splitlines()
                if line.startswith("procs_running ")
            )
            after = self._running_tasks()
        except (OSError, StopIteration, ValueError, IndexError):
            return None
        # our threads read as running just before or after the count (a worker thread that stops
        # spinning between two reads is ours, not a neighbour)
        return max(0, running - len(before | after))

    def steady(self, samples: int = 3, gap_s: float = 0.002) -> int | None:
        """Other processes' running threads now, as the least of a few readings `gap_s` apart (a kernel
        worker or a daemon that runs for a moment is not a neighbour); it starts the average."""
        readings = []
        for index in range(samples):
            if index:
                time.sleep(gap_s)
            reading = self._sample()
            if reading is None:
                return None
            readings.append(reading)
        self._mean = min(readings)
        return self._mean

    def others(self) -> float | None:
        """Other processes' running threads, averaged over the readings so far (None: unknown)."""
        sample = self._sample()
        if sample is None:
            return self._mean
        self._mean = sample if self._mean is None else (1 - self.weight) * self._mean + self.weight * sample
        return self._mean


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
    `window` iterations and `window_s` seconds. Where `load` tells whether other processes run: while
    they do, a smaller count is tried (at once the first time, and where a window runs `slowdown` times
    slower than the best seen at its count) and a larger one only every `max_explore` windows; while
    they do not, never a smaller count and a larger one soon. Elsewhere both ways in turn. A trial takes
    a window; a trial of more threads while others run stops after two iterations where it runs
    `abandon` times slower than the chosen count. The interval between trials starts at `explore`
    windows and doubles, up to `max_explore`, each time a trial loses (it starts again when the machine
    changes)."""

    counts: tuple[int, ...]
    window: int = 4
    window_s: float = 0.05  # and at least this long: a few scheduler time slices
    explore: int = 1
    max_explore: int = 128
    slowdown: float = 1.5
    margin: float = 0.9  # a trial count is kept when its seconds per token are below this share
    abandon: float = 2.0  # a trial running this many times slower than the chosen count stops early
    # fewer threads are tried only while other processes run this many threads (where `load` can
    # tell; everywhere otherwise), more threads as soon as they do not
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
    _tried: set[int] = field(default_factory=set)  # counts a trial has started from

    @classmethod
    def for_setting(cls, value: str, cpus: int | None = None) -> ThreadGovernor:
        """`auto`: every count from the usable CPUs down to 1; a number: that count, fixed."""
        fixed = thread_setting(value)
        if fixed is not None:
            return cls((fixed,))
        return cls(candidate_counts(cpus if cpus is not None else usable_cpus()), load=NeighbourLoad())

    def __post_init__(self) -> None:
        self._interval = self.explore
        if self.load is not None:  # other processes running now: start with fewer threads
            others = self.load.steady()
            self._busy = others is not None and others >= self.neighbour_cpus
            if self._busy and len(self.counts) > 1:
                self.chosen = 1

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
        if (
            self._tried_up
            and self._busy is not False  # a costly trial: more threads while others run
            and self.trial is not None
            and self._iterations >= 2
            and self.chosen in self._recent
        ):
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
        if self.load is not None:
            others = self.load.others()
            if others is not None:
                busy = others >= self.neighbour_cpus
                if busy != self._busy:  # the machine changed: try the other way soon
                    self._interval = self.explore
                self._busy = busy
        busy = self._busy
        up = index - 1 if index > 0 else None
        down = index + 1 if index + 1 < len(self.counts) else None
        due = self._since_trial >= self._interval
        if busy is False:  # nothing else runs: never fewer threads; more where we have fewer
            if up is not None and due:
                self._start_trial(up, up=True)
        elif busy:  # another process runs on our CPUs: fewer threads are worth a try, more rarely are
            slower = best is not None and rate > self.slowdown * best
            if down is not None and (due or slower or index not in self._tried):
                self._start_trial(down, up=False)
            elif up is not None and self._since_trial >= self.max_explore:
                self._start_trial(up, up=True)
        elif due and (up is not None or down is not None):  # no reading here: try both ways in turn
            if up is not None and (down is None or not self._tried_up):
                self._start_trial(up, up=True)
            else:
                assert down is not None
                self._start_trial(down, up=False)

    def _start_trial(self, index: int, up: bool) -> None:
        self._tried.add(self.chosen)
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
