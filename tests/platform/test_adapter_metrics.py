"""Where each adapter version is, in ``/metrics`` (issue 15): ``loraplex_adapter_residency``
labelled by registry version id (never a name or a content hash), capped with ``_other`` per
tier, and its hash -> version cache, which reads the database only for new hashes and on
refresh, and never holds a scrape past its timeout."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.engine.info import Tier
from loraplex.platform import tenants
from loraplex.platform.adapter_metrics import (
    MAX_VERSION_SERIES,
    OTHER,
    AdapterVersionIndex,
    residency_samples,
)
from loraplex.platform.db.models import Adapter, AdapterVersion
from loraplex.platform.store import Store
from tests.utils.fakes import FakeEngineClient
from tests.utils.metrics import Samples, app_for, http, parse, scrape, value
from tests.utils.tenancy import platform_for

pytestmark = pytest.mark.anyio

GAUGE = "loraplex_adapter_residency"
UNKNOWN = hashlib.sha256(b"loaded offline").hexdigest()  # no version of it in the registry


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def add_versions(store: Store, tenant: str, adapter: str, hashes: list[str]) -> list[int]:
    """Versions 1, 2, ... of ``tenant``'s ``adapter`` with these contents; their ids."""
    with store.db.session() as session:
        owner = tenants.get_tenant(session, tenant) or tenants.create_tenant(
            session, "admin", tenant
        )
        row = Adapter(tenant_id=owner.id, name=adapter, next_version=len(hashes) + 1)
        session.add(row)
        session.flush()
        versions = [
            AdapterVersion(
                adapter_id=row.id,
                number=i + 1,
                content_sha256=h,
                storage_path=f"adapters/{h}",
                status="ready",
            )
            for i, h in enumerate(hashes)
        ]
        session.add_all(versions)
        session.flush()
        return [v.id for v in versions]


def delete_version(store: Store, version_id: int) -> None:
    with store.db.session() as session:
        version = session.get(AdapterVersion, version_id)
        assert version is not None
        session.delete(version)


def series(m: Samples) -> dict[tuple[str, str], float]:
    """(adapter_version, tier) -> value of the residency gauge."""
    out = {}
    for (name, labels), v in m.items():
        if name == GAUGE:
            by = dict(labels)
            assert set(by) == {"adapter_version", "tier"}, by
            out[by["adapter_version"], by["tier"]] = v
    return out


# ---- through /metrics, on the platform -------------------------------------------------------


async def test_residency_by_version_id_capped_with_other(tenancy: Any) -> None:
    env = tenancy
    # Two tenants, 130 versions in all (more than the cap); the first upload of each tenant is
    # the same content (one engine copy, two versions).
    acme = [content_hash(f"acme-{i}") for i in range(70)]
    beta = [acme[0]] + [content_hash(f"beta-{i}") for i in range(1, 60)]
    acme_ids = add_versions(env.store, "acme", "secret-acme-adapter", acme)
    beta_ids = add_versions(env.store, "beta", "secret-beta-adapter", beta)
    ids_of = dict(zip(acme, acme_ids, strict=True))
    ids_of.update(zip(beta[1:], beta_ids[1:], strict=True))
    # In the engine: 10 contents on the device, 30 in host memory, the rest on disk, and one
    # adapter loaded offline (the registry knows no version of it) on the device.
    contents = acme + beta[1:]
    residency: dict[str, Tier] = {h: "disk" for h in contents}
    residency.update({h: "device" for h in contents[60:70]})
    residency.update({h: "host" for h in contents[99:129]})
    residency[acme[0]] = "device"
    residency[UNKNOWN] = "device"
    env.fake.engine_stats = {"lora_residency": residency, "lora_registered": len(residency)}

    r = await env.http.get("/metrics", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    got = series(parse(r.text))
    own = {version: tier for (version, tier), v in got.items() if version != OTHER}
    assert len(own) == MAX_VERSION_SERIES
    assert all(got[version, tier] == 1 for version, tier in own.items())
    # Device first: the 11 device versions (the shared content's two included) all have theirs.
    device = {str(ids_of[h]) for h in contents[60:70]} | {str(acme_ids[0]), str(beta_ids[0])}
    assert {v for v, tier in own.items() if tier == "device"} == device
    assert sum(1 for tier in own.values() if tier == "host") == 30
    # The rest: 130 versions, 100 with their own series; the unknown adapter counts on the device.
    assert got[OTHER, "device"] == 1
    assert got[OTHER, "host"] == 0
    assert got[OTHER, "disk"] == 130 - 12 - 30 - (MAX_VERSION_SERIES - 12 - 30)
    assert sum(got.values()) == 130 + 1
    # Bounded labels: registry version ids only; no name, no hash, anywhere in the text.
    all_ids = {str(i) for i in acme_ids + beta_ids}
    assert set(own) <= all_ids
    for secret in ("secret-acme-adapter", "secret-beta-adapter", "acme", "beta", UNKNOWN):
        assert secret not in r.text
    assert not any(h in r.text for h in contents)

    # The engine stops answering: no residency series (no stale gauge).
    env.fake.alive = False
    r = await env.http.get("/metrics", headers=env.admin_headers)
    assert r.status_code == 200 and GAUGE not in r.text


async def test_without_a_registry_every_adapter_is_other(
    fake: FakeEngineClient, tokenizer: Any
) -> None:
    a, b, c = (content_hash(x) for x in "abc")
    fake.engine_stats = {"lora_residency": {a: "device", b: "host", c: "host"}}
    async with http(app_for(fake, tokenizer)) as api:
        m = await scrape(api)
        text = (await api.get("/metrics")).text
    assert series(m) == {(OTHER, "device"): 1, (OTHER, "host"): 2, (OTHER, "disk"): 0}
    assert a not in text and b not in text


async def test_an_engine_that_only_counts_has_no_residency_series(
    fake: FakeEngineClient, tokenizer: Any
) -> None:
    fake.engine_stats = {"lora_resident_device": 2, "lora_registered": 3}  # residency None
    async with http(app_for(fake, tokenizer)) as api:
        m = await scrape(api)
    assert value(m, "loraplex_adapters_resident", tier="device") == 2
    assert series(m) == {}


# ---- the cap, alone --------------------------------------------------------------------------


def test_the_cap_admits_the_device_tier_first_then_by_id() -> None:
    residency: dict[str, Tier] = {"d1": "device", "h1": "host", "k1": "disk", "x": "disk"}
    ids = {"d1": (9,), "h1": (2, 5), "k1": (1,)}  # "x": no version known
    assert residency_samples(residency, ids, cap=2) == [
        ("9", "device", 1.0),
        ("2", "host", 1.0),
        (OTHER, "device", 0.0),
        (OTHER, "host", 1.0),  # version 5
        (OTHER, "disk", 2.0),  # version 1, and "x"
    ]
    assert residency_samples({}, {}, cap=2) == [(OTHER, t, 0.0) for t in ("device", "host", "disk")]


# ---- the cache -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = platform_for(tmp_path)
    yield store
    store.db.dispose()


def counting_reads(index: AdapterVersionIndex) -> list[set[str]]:
    """The hash sets the index reads from the database, in order."""
    seen: list[set[str]] = []
    run = index.db.run

    async def spy(fn: Callable[[Any], Any]) -> Any:
        result = await run(fn)
        seen.append(set(result))
        return result

    index.db.run = spy  # type: ignore[method-assign]
    return seen


async def test_the_index_reads_only_new_hashes_until_it_refreshes(store: Store) -> None:
    a, b, c = (content_hash(x) for x in "abc")
    (va,) = add_versions(store, "acme", "one", [a])
    vb1, vb2 = add_versions(store, "acme", "two", [b, b])  # one content, two versions
    clock = Clock()
    index = AdapterVersionIndex(store.db, refresh_s=30.0, clock=clock)
    reads = counting_reads(index)

    assert await index.lookup([a, b]) == {a: (va,), b: (vb1, vb2)}
    assert await index.lookup([a, b]) == {a: (va,), b: (vb1, vb2)}  # cached
    assert reads == [{a, b}]
    got = await index.lookup([a, b, c, UNKNOWN])  # new hashes: only they are read
    assert reads[1:] == [{c, UNKNOWN}]
    assert got[c] == () and got[UNKNOWN] == ()
    (vc,) = add_versions(store, "beta", "three", [c])
    clock.now += 10
    assert (await index.lookup([a, b, c]))[c] == ()  # not yet: no read for known hashes
    assert len(reads) == 2
    delete_version(store, vb1)
    clock.now += 20  # the refresh: every hash held, read again (and only those)
    assert await index.lookup([b, c]) == {b: (vb2,), c: (vc,)}
    assert reads[2:] == [{b, c}]
    assert index.reads == 3


async def test_a_slow_database_does_not_hold_the_scrape(store: Store) -> None:
    a = content_hash("a")
    (va,) = add_versions(store, "acme", "one", [a])
    index = AdapterVersionIndex(store.db, timeout_s=0.05)
    release = asyncio.Event()
    run = store.db.run

    async def slow(fn: Callable[[Any], Any]) -> Any:
        await release.wait()
        return await run(fn)

    store.db.run = slow  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await index.lookup([a]) == {}  # given up on after the timeout; nothing known yet
    assert loop.time() - started < 1.0
    assert await index.lookup([a]) == {}  # the read still runs: no second one
    assert index.reads == 1
    release.set()
    index.timeout_s = 30.0  # a patient scrape waits for the read already running
    assert await index.lookup([a]) == {a: (va,)}
    assert index.reads == 1


async def test_a_failed_read_leaves_the_database_alone_for_a_while(store: Store) -> None:
    a = content_hash("a")
    (va,) = add_versions(store, "acme", "one", [a])
    clock = Clock()
    index = AdapterVersionIndex(store.db, refresh_s=30.0, clock=clock)
    run = store.db.run
    calls = 0

    async def failing(fn: Callable[[Any], Any]) -> Any:
        nonlocal calls
        calls += 1
        raise OSError("database is locked")

    store.db.run = failing  # type: ignore[method-assign]
    assert await index.lookup([a]) == {}
    clock.now += 5
    assert await index.lookup([a]) == {}
    assert calls == 1
    store.db.run = run  # type: ignore[method-assign]
    clock.now += 30
    assert await index.lookup([a]) == {a: (va,)}


async def test_a_deleted_version_leaves_the_gauge_at_the_refresh(
    tmp_path: Path, fake: FakeEngineClient, tokenizer: Any
) -> None:
    from tests.utils.tenancy import tenancy_env

    a = content_hash("a")
    async with tenancy_env(tmp_path, fake, tokenizer) as env:
        v1, v2 = add_versions(env.store, "acme", "one", [a, a])
        fake.engine_stats = {"lora_residency": {a: "host"}}
        index = env.app.platform.metrics.residency.index
        assert index is not None
        clock = Clock()
        index.clock = clock

        async def residency() -> dict[tuple[str, str], float]:
            r = await env.http.get("/metrics", headers=env.admin_headers)
            assert r.status_code == 200, r.text
            return {k: v for k, v in series(parse(r.text)).items() if v}

        assert await residency() == {(str(v1), "host"): 1, (str(v2), "host"): 1}
        delete_version(env.store, v1)
        clock.now += index.refresh_s
        assert await residency() == {(str(v2), "host"): 1}
        delete_version(env.store, v2)  # no version names it: the registry no longer knows it
        clock.now += index.refresh_s
        assert await residency() == {(OTHER, "host"): 1}
