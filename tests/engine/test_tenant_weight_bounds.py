"""Issue 31: a tenant's weight is bounded (``TENANT_WEIGHT_RANGE``), so every fair counter stays
finite. A weight of 5e-324 used to be accepted: the tenant's counter became +inf, stayed +inf
after the weight was set back, and spread to tenants lifted to it."""

from __future__ import annotations

import math

import pytest

from loraplex.config import TENANT_WEIGHT_RANGE
from tests.utils.scheduler_drive import Drive


def test_the_engine_refuses_a_weight_outside_the_range_and_keeps_the_last() -> None:
    d = Drive()
    d.sched.set_tenant_weights({"a": 2.0})
    for bad in (5e-324, 1e-3, 101.0, 1e308):
        with pytest.raises(ValueError, match=r"tenant 'b' must be a number from 0.01 to 100"):
            d.sched.set_tenant_weights({"a": 1.0, "b": bad})
    assert d.sched.tenant_weights == {"a": 2.0}  # a refused set changes nothing


def test_counters_stay_finite_at_the_ends_of_the_range() -> None:
    low, high = TENANT_WEIGHT_RANGE
    d = Drive(seed=3)
    d.sched.set_tenant_weights({"a": low, "b": high})
    d.backlogged = {"a": 6, "b": 6, "c": 6}
    tokens = d.run(1500)
    counters = d.sched.waiting.virtual_service()
    assert counters is not None and set(counters) == {"a", "b", "c"}
    assert all(math.isfinite(v) for v in counters.values()), counters
    assert all(tokens[t] > 0 for t in "abc"), tokens  # the light tenant is not shut out
    d.sched.set_tenant_weights({})  # back to equal shares: everyone keeps being served
    d.backlogged["d"] = 6
    tokens = d.run(500)
    assert all(tokens.get(t, 0) > 0 for t in "abcd"), tokens
    counters = d.sched.waiting.virtual_service()
    assert counters is not None and all(math.isfinite(v) for v in counters.values())
    d.finish()
