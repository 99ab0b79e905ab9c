"""Fewer compute threads while a neighbour holds the CPUs, all of them again when it leaves.

With one busy neighbour on 2 cores (``python -m benchmarks.contention``), the engine's two
OpenMP threads share one core's worth of time, and every parallel region waits for the thread
that is descheduled: batch-1 decode falls well below what one thread alone does on the core it
gets (figures in docs/benchmarks.md). The governor watches how much CPU the engine's steps really get: the
process CPU time over the wall time of each step, summed over a window of steps. When ``n``
threads get less than ``DROP_BELOW`` of ``n`` cores, it drops to one thread; at one thread it
tries ``n`` again every ``PROBE_EVERY_S`` seconds for one window and keeps them only if they then
get their cores. Quiet, the steps get about 1.9 of 2 cores and nothing changes.

Pure bookkeeping with injectable clocks and thread setter, so a test drives it without torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Fraction of n cores below which n threads are not getting their cores (quiet: ~0.95 of 2 cores
# over a run; one busy neighbour on 2 cores: ~0.5).
DROP_BELOW = 0.7
WINDOW_S = 0.5  # wall time of steps per decision
PROBE_EVERY_S = 5.0  # at one thread, how often to try all of them again


@dataclass
class GovernorStats:
    drops: int = 0  # times the engine went to one thread
    restores: int = 0  # times a probe kept all threads
    threads: int = 0  # threads now


class ThreadGovernor:
    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        cpu_clock: Callable[[], float] = time.process_time,
        wall_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self.max_threads = max_threads
        self._set = set_threads
        self._cpu, self._wall = cpu_clock, wall_clock
        self.threads = max_threads
        self._probing = False
        self._win_cpu = self._win_wall = 0.0
        self._since_drop = 0.0  # wall time of steps run at one thread since the last probe
        self._start: tuple[float, float] | None = None
        self.stats = GovernorStats(threads=max_threads)

    def step_started(self) -> None:
        self._start = (self._cpu(), self._wall())

    def step_finished(self) -> None:
        if self._start is None or self.max_threads == 1:
            return
        cpu0, wall0 = self._start
        self._start = None
        self._win_cpu += self._cpu() - cpu0
        self._win_wall += self._wall() - wall0
        if self.threads == 1 and not self._probing:
            self._since_drop += self._wall() - wall0
            self._win_cpu = self._win_wall = 0.0
            if self._since_drop >= PROBE_EVERY_S:
                self._since_drop = 0.0
                self._probing = True
                self._use(self.max_threads)
            return
        if self._win_wall < WINDOW_S:
            return
        share = self._win_cpu / self._win_wall / self.threads  # of the cores the threads need
        self._win_cpu = self._win_wall = 0.0
        if share < DROP_BELOW:
            if not self._probing:
                self.stats.drops += 1
            self._probing = False
            self._use(1)
        elif self._probing:
            self._probing = False
            self.stats.restores += 1

    def _use(self, n: int) -> None:
        self.threads = n
        self.stats.threads = n
        self._set(n)
