"""``serve --data-parallel-size N --dp-routing P`` builds N supervised engine processes behind
the data-parallel router (nothing started here); sizes that do not fit, and in-process DP, are
refused with a message that says what to change."""

from __future__ import annotations

import pytest

from loraplex.cli import UsageError, build_parser
from loraplex.engine.dp_client import DataParallelClient, usable_cpu_list
from loraplex.engine.proc_client import ProcEngineClient
from loraplex.engine_args import from_args
from loraplex.server.serve import build_engine_client


def _client(*flags: str) -> object:
    args = build_parser().parse_args(["serve", "/no/model", "--device", "cpu", *flags])
    return build_engine_client(args, from_args(args, model=args.model), args.model)


def test_one_replica_is_the_plain_process_client() -> None:
    assert type(_client()) is ProcEngineClient


@pytest.mark.skipif(len(usable_cpu_list()) < 2, reason="needs 2 CPUs for 2 replicas")
def test_two_replicas_on_disjoint_cpus_with_the_routing_asked_for() -> None:
    client = _client("--data-parallel-size", "2", "--dp-routing", "round_robin")
    assert isinstance(client, DataParallelClient) and client.routing == "round_robin"
    shares = [r.placement.cpus for r in client.replicas if isinstance(r, ProcEngineClient)]
    assert len(shares) == 2 and not set(shares[0]) & set(shares[1])
    assert _client("--data-parallel-size", "2").routing == "affinity"  # type: ignore[attr-defined]


def test_sizes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="needs at least 4096 CPUs"):
        _client("--data-parallel-size", "4096")
    with pytest.raises(ValueError, match="--engine-in-process runs one engine"):
        _client("--data-parallel-size", "2", "--engine-in-process")
    with pytest.raises(UsageError, match="invalid choice: 'random'"):
        build_parser().parse_args(["serve", "--dp-routing", "random"])
