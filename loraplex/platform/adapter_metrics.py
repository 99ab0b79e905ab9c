"""Where the engine holds each adapter version, and which failed to load, for ``/metrics``,
with bounded labels::

    loraplex_adapter_residency{adapter_version="<version id>", tier="device|host|disk"} 1
    loraplex_adapter_failed{tenant="<tenant id>", adapter="<name>", version="<N>"} 1

The engine knows adapters by content hash (``LoRAStats.residency``); the label is the registry's
version id (``AdapterVersion.id``), never a name or a hash. One content shared by several
versions (equal uploads) gives each of them a series at that content's tier. At most
``MAX_VERSION_SERIES`` versions get their own series (the device tier first, then host, then
disk; by id within a tier); ``adapter_version="_other"`` counts the rest per tier, and the
adapters the registry does not know (loaded offline, or deleted meanwhile), one per content
hash. The three ``_other`` series are always there while the engine answers.

The hash -> version map (``AdapterVersionIndex``) is a cache, so that a scrape is not a query of
the whole registry: a hash seen for the first time is looked up at once (the adapters the engine
newly holds, only those), and every hash the engine holds is read again every ``REFRESH_S``
seconds (deleted versions go, a new version of content already held appears). At most one read
runs at a time, in a worker thread; a scrape waits for it at most ``LOOKUP_TIMEOUT_S`` (a slower
read lands in the cache for the next scrape); after a failed read the database is left alone
for ``REFRESH_S``.

``loraplex_adapter_failed`` has a series for each version whose content the engine failed to
load (``LoRAStats.failed``, until it is added again or retried): its tenant's id, the adapter's
name (a tenant's slug) and the version's number, at most ``MAX_VERSION_SERIES`` of them; the
rest, and contents the registry does not know, are counted in one series with ``_other`` in
every label. Failed contents are few: they are looked up at each scrape that has some.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.engine.info import EngineStats, Tier
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import Adapter, AdapterVersion

logger = logging.getLogger(__name__)

MAX_VERSION_SERIES = 100  # versions with their own series; the rest are summed into _other
OTHER = "_other"
TIERS: tuple[Tier, ...] = ("device", "host", "disk")  # also the order in which the cap admits
REFRESH_S = 30.0
LOOKUP_TIMEOUT_S = 2.0
LOOKUP_CHUNK = 500  # hashes per IN (...) clause: under every database's parameter limit

VersionIds = Mapping[str, tuple[int, ...]]  # content hash -> version ids (empty: none known)


def version_ids(session: Session, hashes: Collection[str]) -> dict[str, tuple[int, ...]]:
    """The ids of the versions, of every tenant, whose content is one of ``hashes``. An
    operator-wide read, like the registry's garbage collection: only ids leave it."""
    found: dict[str, list[int]] = {h: [] for h in hashes}
    keys = sorted(found)
    for start in range(0, len(keys), LOOKUP_CHUNK):
        chunk = keys[start : start + LOOKUP_CHUNK]
        query = select(AdapterVersion.content_sha256, AdapterVersion.id).where(
            AdapterVersion.content_sha256.in_(chunk)
        )
        for content, version_id in session.execute(query):
            found[content].append(version_id)
    return {h: tuple(sorted(ids)) for h, ids in found.items()}


class AdapterVersionIndex:
    """Content hash -> registry version ids, cached (see the module's docstring)."""

    def __init__(
        self,
        db: Database,
        *,
        refresh_s: float = REFRESH_S,
        timeout_s: float = LOOKUP_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.reads = 0  # database reads started (tests count them)
        self._ids: dict[str, tuple[int, ...]] = {}  # every hash looked up since the last full read
        self._full_at: float | None = None  # when the last full read started
        self._quiet_until = float("-inf")  # no reads before (after a failure)
        self._read: asyncio.Task[None] | None = None

    async def lookup(self, hashes: Collection[str]) -> VersionIds:
        """Version ids for ``hashes`` as far as known now (a hash absent or mapped to ``()``:
        the registry has no version of it, or the read is still running)."""
        if self._read is None:
            self._start_read(set(hashes))
        read = self._read
        if read is not None:
            try:
                await asyncio.wait_for(asyncio.shield(read), self.timeout_s)
            except asyncio.TimeoutError:
                logger.warning(
                    "metrics: the adapter versions' read takes over %g s; its result goes to a "
                    "later scrape",
                    self.timeout_s,
                )
        return self._ids

    def _start_read(self, wanted: set[str]) -> None:
        now = self.clock()
        if now < self._quiet_until:
            return
        full = self._full_at is None or now - self._full_at >= self.refresh_s
        todo = wanted if full else wanted - self._ids.keys()
        if full:
            self._full_at = now
        if not todo:
            if full:
                self._ids = {}
            return
        self.reads += 1
        self._read = asyncio.ensure_future(self._fetch(todo, full))

    async def _fetch(self, hashes: set[str], full: bool) -> None:
        try:
            found = await self.db.run(lambda session: version_ids(session, hashes))
        except Exception as exc:  # the scrape goes on with what is known
            logger.warning("metrics: cannot read the adapter versions: %s", exc)
            self._quiet_until = self.clock() + self.refresh_s
            if full:
                self._full_at = None  # the next read after the quiet spell is a full one
        else:
            self._ids = found if full else {**self._ids, **found}
        finally:
            self._read = None


def residency_samples(
    residency: Mapping[str, Tier], ids: VersionIds, cap: int = MAX_VERSION_SERIES
) -> list[tuple[str, Tier, float]]:
    """(adapter_version, tier, value) for the gauge: 1 per version among the first ``cap``,
    then ``_other`` per tier with the count of the rest."""
    order = {tier: i for i, tier in enumerate(TIERS)}
    versions = sorted(
        (order[tier], version_id, tier)
        for key, tier in residency.items()
        if tier in order
        for version_id in ids.get(key, ())
    )
    other = dict.fromkeys(TIERS, 0)
    for key, tier in residency.items():
        if tier in other and not ids.get(key):
            other[tier] += 1
    for _, _, tier in versions[cap:]:
        other[tier] += 1
    own = [(str(version_id), tier, 1.0) for _, version_id, tier in versions[:cap]]
    return own + [(OTHER, tier, float(other[tier])) for tier in TIERS]


class ResidencyCollector:
    """A prometheus collector of ``loraplex_adapter_residency`` over the latest snapshot
    (``await update`` before each collection; ``None``: the engine did not answer). Without a
    registry (``index`` None: the single-operator server) every adapter is in ``_other``."""

    def __init__(
        self, index: AdapterVersionIndex | None = None, *, cap: int = MAX_VERSION_SERIES
    ) -> None:
        self.index = index
        self.cap = cap
        self._samples: list[tuple[str, Tier, float]] = []

    async def update(self, stats: EngineStats | None) -> None:
        lora = stats.lora if stats is not None else None
        residency = lora.residency if lora is not None else None
        if residency is None:  # no answer, no adapters, or an engine that only counts
            self._samples = []
            return
        ids = await self.index.lookup(residency.keys()) if self.index is not None else {}
        self._samples = residency_samples(residency, ids, self.cap)

    def describe(self) -> Iterable[Metric]:
        return list(self._families(include_all=True))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(include_all=False))

    def _families(self, include_all: bool) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "loraplex_adapter_residency",
            "Where the engine holds each adapter version (1 at its tier), by registry version "
            f"id; past the first {self.cap}, and for adapters the registry does not know, "
            f"{OTHER} counts them per tier.",
            labels=["adapter_version", "tier"],
        )
        for version, tier, count in self._samples:
            gauge.add_metric([version, tier], count)
        if include_all or gauge.samples:
            yield gauge


# ---- adapters that failed to load ---------------------------------------------------------------

FailedVersion = tuple[str, str, str]  # (tenant id, adapter name, version number), as labels


def failed_versions(session: Session, hashes: Collection[str]) -> list[FailedVersion]:
    """The versions, of every tenant, whose content is one of ``hashes``: their labels, in
    order (an operator-wide read, like ``version_ids``)."""
    found: list[tuple[int, str, int]] = []
    keys = sorted(hashes)
    for start in range(0, len(keys), LOOKUP_CHUNK):
        query = (
            select(Adapter.tenant_id, Adapter.name, AdapterVersion.number)
            .join(AdapterVersion, AdapterVersion.adapter_id == Adapter.id)
            .where(AdapterVersion.content_sha256.in_(keys[start : start + LOOKUP_CHUNK]))
        )
        found += [(t, n, v) for t, n, v in session.execute(query)]
    return [(str(t), name, str(v)) for t, name, v in sorted(found)]


class FailedCollector:
    """``loraplex_adapter_failed`` over the latest snapshot (``await update`` before each
    collection). Without a database (the single-operator server) every failed adapter is in
    ``_other``."""

    def __init__(
        self,
        db: Database | None = None,
        *,
        cap: int = MAX_VERSION_SERIES,
        timeout_s: float = LOOKUP_TIMEOUT_S,
    ) -> None:
        self.db = db
        self.cap = cap
        self.timeout_s = timeout_s
        self._own: list[FailedVersion] = []
        self._other = 0

    async def update(self, stats: EngineStats | None) -> None:
        lora = stats.lora if stats is not None else None
        failed = set(lora.failed) if lora is not None else set()  # content hashes
        self._own, self._other = [], 0
        if not failed:
            return
        versions: list[FailedVersion] = []
        known: set[str] = set()
        if self.db is not None:
            hashes = sorted(failed)

            def read(session: Session) -> tuple[list[FailedVersion], set[str]]:
                found = failed_versions(session, hashes)
                ids = version_ids(session, hashes)
                return found, {h for h, v in ids.items() if v}

            try:
                versions, known = await asyncio.wait_for(self.db.run(read), self.timeout_s)
            except Exception as exc:  # counted in _other until a scrape can read them
                logger.warning("metrics: cannot read the failed adapters' versions: %s", exc)
        self._own = versions[: self.cap]
        self._other = len(versions) - len(self._own) + len(failed - known)

    def describe(self) -> Iterable[Metric]:
        return list(self._families(include_all=True))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(include_all=False))

    def _families(self, include_all: bool) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "loraplex_adapter_failed",
            "1 for each adapter version the engine failed to load (its requests end with the "
            f"reason; an upload again or a retry clears it); past the first {self.cap}, and "
            f"for adapters the registry does not know, {OTHER} counts them.",
            labels=["tenant", "adapter", "version"],
        )
        for labels in self._own:
            gauge.add_metric(list(labels), 1.0)
        if self._other:
            gauge.add_metric([OTHER, OTHER, OTHER], float(self._other))
        if include_all or gauge.samples:
            yield gauge
