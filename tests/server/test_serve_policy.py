"""``loraplex serve`` schedules tenants fairly by default, and a single caller (``--no-platform``)
first come first served; the flag and the environment choose otherwise."""

from __future__ import annotations

import pytest

from loraplex.cli import build_parser
from loraplex.engine_args import from_args
from loraplex.server.serve import apply_default_policy


@pytest.mark.parametrize(
    ("argv", "env", "policy"),
    [
        ([], {}, "fair"),
        (["--no-platform"], {}, "fcfs"),
        (["--scheduling-policy", "priority"], {}, "priority"),
        (["--no-platform", "--scheduling-policy", "fair"], {}, "fair"),
        ([], {"LORAPLEX_SCHEDULING_POLICY": "fcfs"}, "fcfs"),
    ],
)
def test_the_serve_policy(
    argv: list[str], env: dict[str, str], policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LORAPLEX_SCHEDULING_POLICY", raising=False)
    monkeypatch.delenv("LORAPLEX_NO_PLATFORM", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve", *argv])
    config = from_args(apply_default_policy(args))
    assert config.scheduler.scheduling_policy == policy
