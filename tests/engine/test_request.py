"""The engine-core requests of one client request: samples, tenant and priority."""

from __future__ import annotations

from loraplex.engine.client import build_core_requests
from loraplex.engine.request import Request
from loraplex.sampling_params import SamplingParams


def test_defaults_are_no_tenant_and_priority_zero() -> None:
    r = Request("a", [1, 2], SamplingParams())
    assert r.tenant is None and r.priority == 0


def test_every_sample_carries_tenant_and_priority() -> None:
    reqs = build_core_requests(
        "r",
        [1, 2, 3],
        SamplingParams(n=3, seed=7),
        frozenset({0}),
        lora_key="abc",
        cache_extra_keys=("salt",),
        tenant="t-42",
        priority=-3,
    )
    assert len(reqs) == 3
    assert [(r.tenant, r.priority) for r in reqs] == [("t-42", -3)] * 3
    assert [r.parent_id for r in reqs] == [None, reqs[0].request_id, reqs[0].request_id]
    assert all(r.cache_extra_keys == ("lora:abc", "salt") for r in reqs)


def test_callers_without_tenant_keep_the_defaults() -> None:
    (r,) = build_core_requests(
        "r", [1], SamplingParams(), frozenset(), lora_key=None, cache_extra_keys=()
    )
    assert r.tenant is None and r.priority == 0
