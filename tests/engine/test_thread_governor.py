"""The thread governor on fake clocks: one thread while a neighbour holds the cores, all of them
again once a probe finds the cores free, and no change on a quiet machine."""

from __future__ import annotations

from loraplex.engine.thread_governor import PROBE_EVERY_S, WINDOW_S, ThreadGovernor


class Machine:
    """Each step takes ``step_s`` of wall time; the process gets ``cores`` CPUs' worth of it
    (at most the threads it runs)."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.cpu = self.wall = 0.0
        self.threads_set: list[int] = []

    def run(self, gov: ThreadGovernor, seconds: float, step_s: float = 0.05) -> None:
        for _ in range(round(seconds / step_s)):
            gov.step_started()
            self.wall += step_s
            self.cpu += step_s * min(self.cores, gov.threads)
            gov.step_finished()


def governor(m: Machine, threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(threads, m.threads_set.append, lambda: m.cpu, lambda: m.wall)


def test_a_quiet_machine_keeps_every_thread() -> None:
    m = Machine(cores=1.9)
    gov = governor(m)
    m.run(gov, 30)
    assert gov.threads == 2 and m.threads_set == [] and gov.stats.drops == 0


def test_a_busy_neighbour_drops_to_one_thread_and_its_leaving_restores_them() -> None:
    m = Machine(cores=1.0)  # a neighbour holds one of the two cores
    gov = governor(m)
    m.run(gov, 2 * WINDOW_S)
    assert gov.threads == 1 and gov.stats.drops == 1
    m.run(gov, 3 * PROBE_EVERY_S)  # probes find the core still taken: back to one each time
    assert gov.threads == 1 and gov.stats.restores == 0 and 2 in m.threads_set
    m.cores = 2.0  # the neighbour left
    m.run(gov, PROBE_EVERY_S + 2 * WINDOW_S)
    assert gov.threads == 2 and gov.stats.restores == 1
    m.run(gov, 10)
    assert gov.threads == 2 and gov.stats.drops == 1


def test_one_thread_engines_and_idle_time_are_left_alone() -> None:
    m = Machine(cores=0.3)
    gov = governor(m, threads=1)
    m.run(gov, 10)
    assert m.threads_set == []
    m = Machine(cores=2.0)
    gov = governor(m)
    gov.step_started()
    m.wall += 60.0  # a long idle gap inside no step does not count: only steps are measured
    m.cpu += 120.0
    gov.step_finished()
    assert gov.threads == 2
