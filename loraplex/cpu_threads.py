"""How many CPU threads the engine may use, and how they wait. A leaf: imports no torch.

torch, MKL and loraplex's native kernels share one OpenMP runtime (torch's ``libgomp``; the
native library's ``libgomp.so.1`` resolves to the copy torch already loaded). At the end of every
parallel region GNU OpenMP spins its idle threads for ``GOMP_SPINCOUNT`` iterations (300,000 by
default, about a millisecond here) before they sleep. That is free on an idle machine and a
disaster on a busy one: with another runnable process on the core, the spinning thread burns the
time slice its partner needs, and a decode step (hundreds of parallel regions) runs many times
slower (``python -m benchmarks.contention --busy 0,1 --spincounts default,1000,10000``, from the
repository, measures it).

``configure_openmp()`` sets a bounded spin count before torch is imported (the runtime reads it
once, at load), unless the user set ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` themselves;
``LORAPLEX_OMP_SPINCOUNT`` chooses another value (``default`` leaves the runtime's own).
``usable_cpus()`` is the CPU count this process may really use: its affinity mask, capped by a
cgroup CPU quota (containers), so the engine never starts more threads than it has cores.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

SPIN_ENV = "LORAPLEX_OMP_SPINCOUNT"
# Iterations an idle OpenMP thread spins before it sleeps (GNU OpenMP's GOMP_SPINCOUNT). Chosen
# by ``python -m benchmarks.contention`` (docs/benchmarks.md): short enough that a descheduled
# partner costs little, long enough that back-to-back parallel regions of a quiet decode step do
# not sleep and wake.
DEFAULT_SPINCOUNT = 10_000


def configure_openmp(environ: dict[str, str] | None = None) -> str | None:
    """Set ``GOMP_SPINCOUNT`` for this process and its children; returns the value set (None:
    left alone, because the user chose a wait policy or torch is already loaded)."""
    env = os.environ if environ is None else environ
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return None
    if environ is None and "torch" in sys.modules:
        return None  # too late: the runtime read its settings when torch loaded
    choice = env.get(SPIN_ENV, "").strip().lower()
    if choice == "default":
        return None
    if choice:
        if not choice.isdigit():
            raise ValueError(
                f"{SPIN_ENV}={choice!r}: use a whole number of spins (e.g. 10000) or 'default'"
            )
        value = choice
    else:
        value = str(DEFAULT_SPINCOUNT)
    env["GOMP_SPINCOUNT"] = value
    return value


def _cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup (v2 ``cpu.max``, else v1 ``cfs_quota_us``); None: no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup quota (rounded up)."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    limit = _cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        count = min(count, max(1, math.ceil(limit)))
    return max(1, count)
