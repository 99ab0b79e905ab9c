"""``loraplex bench``: the commands come from one table (``loraplex.bench.registry``), building
the parser stays light, and a command that moved to ``benchmarks/`` says where it went."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.bench.registry import BENCHES, MOVED
from loraplex.cli import main


def test_the_bench_commands_are_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(BENCHES) == ["throughput", "fairness"] and not set(BENCHES) & set(MOVED)
    assert main(["bench", "nope"]) == 2
    assert "(choose from 'throughput', 'fairness')" in capsys.readouterr().err


def test_a_moved_bench_says_where_it_went(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "masks", "--streams", "8"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "loraplex: error: 'bench masks' moved out of the package: from a clone of the "
        "repository, run python -m benchmarks.masks --streams 8"
    )


def test_the_cli_parser_does_not_import_the_bench_http_client() -> None:
    """``loraplex prepare`` runs where only the engine's dependencies are installed (the Docker
    image's install): building the parser must not import httpx (nor torch) through a bench."""
    code = (
        "import sys; from loraplex.cli import build_parser; build_parser(); "
        "bad = sorted(m for m in sys.modules if m in ('httpx', 'torch')); print(bad); "
        "sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_wheel_leaves_benchmarks_out_and_the_package_never_imports_them() -> None:
    """benchmarks/ runs from a clone only: the wheel's package discovery must not find it, and
    nothing under loraplex/ may import it (an installed loraplex has no ``benchmarks``)."""
    import tomllib
    from setuptools import find_packages

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(where=str(root), include=include)
    assert "loraplex.bench" in packages
    assert all(p.split(".")[0] == "loraplex" for p in packages), packages
    importing = re.compile(r"^\s*(from|import)\s+benchmarks\b", re.M)
    offenders = [
        str(p.relative_to(root))
        for p in sorted((root / "loraplex").rglob("*.py"))
        if importing.search(p.read_text(encoding="utf-8"))
    ]
    assert not offenders
