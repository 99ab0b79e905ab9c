"""OpenMP wait policy and CPU count: set before torch loads, respecting the user's choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.cpu_threads import DEFAULT_SPINCOUNT, SPIN_ENV, configure_openmp, usable_cpus


def test_sets_a_bounded_spin_count_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert configure_openmp(env) == str(DEFAULT_SPINCOUNT)
    assert env["GOMP_SPINCOUNT"] == str(DEFAULT_SPINCOUNT)
    for mine in ({"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "active"}):
        env = dict(mine)
        assert configure_openmp(env) is None and env == mine
    env = {SPIN_ENV: "2500"}
    assert configure_openmp(env) == "2500" and env["GOMP_SPINCOUNT"] == "2500"
    env = {SPIN_ENV: "default"}
    assert configure_openmp(env) is None and "GOMP_SPINCOUNT" not in env


def test_a_bad_spin_count_says_what_it_takes() -> None:
    with pytest.raises(ValueError, match="whole number of spins"):
        configure_openmp({SPIN_ENV: "fast"})


def test_importing_loraplex_sets_it_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", SPIN_ENV)}
    code = (
        "import loraplex, os, sys; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [str(DEFAULT_SPINCOUNT), "False"]


def test_usable_cpus_is_capped_by_a_cgroup_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    assert usable_cpus(tmp_path) == min(2, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path / "missing") == len(os.sched_getaffinity(0))
