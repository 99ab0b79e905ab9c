"""Numbers for the Overview page: the engine's state now, and the last hour in 10-second slots.

``LiveRecorder`` keeps one ``Slot`` per 10 seconds for the last hour (360 slots; older ones are
dropped as time moves on): requests finished, tokens generated, and a log-bucket histogram of
time to first token, so p50/p99 cost a few hundred integers per slot whatever the load. It is fed
one call per finished request: ``observe(ttft_s, tokens)``, or ``observe_record(record)`` as a
``RequestLogMiddleware`` observer.

``EngineView`` is one reading of ``EngineClient.stats()``; a dead or hung engine is a view with
``up=False`` and the reason, never an exception.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.client import EngineClient, EngineStats
from loraplex.platform.engine_state import EngineNotAnswering, read_engine_stats
from loraplex.platform.request_log import RequestRecord

SLOT_S = 10.0
WINDOW_SLOTS = 360  # one hour of 10-second slots
COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

# TTFT histogram buckets: bucket i holds [BASE * RATIO**i, BASE * RATIO**(i+1)); a quantile is
# reported as its bucket's geometric middle, so within ±4% of the true value.
_BASE_S = 1e-4
_RATIO = 1.08
_LOG_RATIO = math.log(_RATIO)


class LatencyHistogram:
    """A sparse log-bucket histogram of durations in seconds."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.total = 0

    def add(self, seconds: float) -> None:
        bucket = 0 if seconds <= _BASE_S else int(math.log(seconds / _BASE_S) / _LOG_RATIO)
        self.counts[bucket] += 1
        self.total += 1

    def merge(self, other: LatencyHistogram) -> None:
        self.counts.update(other.counts)
        self.total += other.total

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0 < q <= 1) in seconds; None when empty."""
        if self.total == 0:
            return None
        rank = max(1, math.ceil(q * self.total))
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return float(_BASE_S * _RATIO ** (bucket + 0.5))
        raise AssertionError("unreachable: rank <= total")


@dataclass
class Slot:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    ttft: LatencyHistogram = field(default_factory=LatencyHistogram)
    by_tenant: Counter[str] = field(default_factory=Counter)  # tokens per tenant id


NO_TENANT = "-"  # the operator's requests (no tenant)
OTHERS = "_others"  # the tenants past the chart's top ones, together


@dataclass(frozen=True)
class TenantShares:
    """Each tenant's share of the tokens generated, per point of ``point_s`` seconds over the
    last hour (oldest first; None where no token was generated, or before the recorder ran).
    The ``top`` tenants by tokens have a line each; the rest are summed under ``OTHERS``."""

    point_s: float
    shares: dict[str, list[float | None]]
    totals: dict[str, int]  # tokens over the hour, by the same keys


@dataclass(frozen=True)
class Window:
    """The last hour, oldest slot first; ``None`` where the recorder was not running yet."""

    slot_s: float
    tokens_per_s: list[float | None]
    ttft_p50_s: list[float | None]
    ttft_p99_s: list[float | None]
    requests: int
    errors: int
    tokens: int
    ttft_p50_all_s: float | None
    ttft_p99_all_s: float | None


class LiveRecorder:
    def __init__(
        self,
        *,
        slot_s: float = SLOT_S,
        slots: int = WINDOW_SLOTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slot_s = slot_s
        self.slots = slots
        self._clock = clock
        self._first = self._index()  # slots before this one hold no data (not "zero")
        self._data: dict[int, Slot] = {}
        self._lock = threading.Lock()  # observe() may be called from any thread

    def _index(self) -> int:
        return math.floor(self._clock() / self.slot_s)

    def observe(
        self, ttft_s: float | None, tokens: int, *, ok: bool = True, tenant: str | None = None
    ) -> None:
        """Count one finished request: its time to first token (None: no token came), the
        tokens it generated and its tenant's id (None: the operator's)."""
        now = self._index()
        with self._lock:
            slot = self._data.get(now)
            if slot is None:
                slot = self._data[now] = Slot()
                for old in [i for i in self._data if i <= now - self.slots]:
                    del self._data[old]
            slot.requests += 1
            slot.errors += 0 if ok else 1
            slot.tokens += max(0, tokens)
            slot.by_tenant[tenant or NO_TENANT] += max(0, tokens)
            if ttft_s is not None and ttft_s >= 0:
                slot.ttft.add(ttft_s)

    def observe_record(self, record: RequestRecord) -> None:
        """``RequestLogMiddleware`` observer: counts completion requests that reached the engine."""
        if record.path not in COMPLETION_PATHS or not record.generated:
            return
        ttft = None
        if record.first_token_time is not None:
            ttft = max(0.0, record.first_token_time - record.start)
        status = record.stream_error_status or record.status or 500
        ok = status < 400 or status == 499
        self.observe(ttft, record.completion_tokens, ok=ok, tenant=record.tenant_id)

    def recent_tokens_per_s(self, seconds: float = 60.0) -> float:
        """Generated tokens per second over the last ``seconds`` (finished requests only)."""
        now = self._index()
        span = max(1, math.ceil(seconds / self.slot_s))
        with self._lock:
            tokens = sum(
                self._data[i].tokens for i in range(now - span + 1, now + 1) if i in self._data
            )
        elapsed = min(span * self.slot_s, (now - self._first + 1) * self.slot_s)
        return tokens / elapsed if elapsed > 0 else 0.0

    def window(self) -> Window:
        clock = self._clock()
        now = math.floor(clock / self.slot_s)
        indices = range(now - self.slots + 1, now + 1)
        tokens_per_s: list[float | None] = []
        p50: list[float | None] = []
        p99: list[float | None] = []
        everything = LatencyHistogram()
        requests = errors = tokens = 0
        with self._lock:
            for i in indices:
                slot = self._data.get(i)
                if i < self._first:
                    tokens_per_s.append(None)
                    p50.append(None)
                    p99.append(None)
                    continue
                if slot is None:
                    slot = Slot()
                # The slot in progress is averaged over its elapsed part, so the line's last
                # point does not dip just because the slot has only just begun.
                span = self.slot_s if i < now else max(1.0, clock - i * self.slot_s)
                tokens_per_s.append(slot.tokens / span)
                p50.append(slot.ttft.quantile(0.5))
                p99.append(slot.ttft.quantile(0.99))
                everything.merge(slot.ttft)
                requests += slot.requests
                errors += slot.errors
                tokens += slot.tokens
        return Window(
            slot_s=self.slot_s,
            tokens_per_s=tokens_per_s,
            ttft_p50_s=p50,
            ttft_p99_s=p99,
            requests=requests,
            errors=errors,
            tokens=tokens,
            ttft_p50_all_s=everything.quantile(0.5),
            ttft_p99_all_s=everything.quantile(0.99),
        )

    def tenant_shares(self, *, group: int = 6, top: int = 5) -> TenantShares:
        """Shares over the last hour, ``group`` slots to a point (6: one point a minute)."""
        now = self._index()
        first = now - self.slots + 1
        points: list[Counter[str] | None] = []
        totals: Counter[str] = Counter()
        with self._lock:
            for start in range(first, now + 1, group):
                if start + group - 1 < self._first:
                    points.append(None)  # the recorder was not running yet
                    continue
                point: Counter[str] = Counter()
                for i in range(start, min(start + group, now + 1)):
                    if i in self._data:
                        point.update(self._data[i].by_tenant)
                points.append(point)
                totals.update(point)
        totals = +totals  # a tenant with no token in the hour gets no line (nor legend entry)
        kept = [t for t, _ in totals.most_common(top)]
        keys = kept + ([OTHERS] if len(totals) > top else [])
        shares: dict[str, list[float | None]] = {k: [] for k in keys}
        for got in points:
            whole = sum(got.values()) if got else 0
            for key in keys:
                if got is None or whole == 0:
                    shares[key].append(None)
                    continue
                n = got[key] if key != OTHERS else whole - sum(got[t] for t in kept)
                shares[key].append(n / whole)
        summed = {k: totals[k] for k in kept}
        if OTHERS in keys:
            summed[OTHERS] = sum(totals.values()) - sum(summed.values())
        return TenantShares(point_s=self.slot_s * group, shares=shares, totals=summed)


class CounterRate:
    """The rate of a monotonic counter read at irregular times (each Overview poll), over the
    last ``window_s`` seconds. A counter that went down (the engine restarted) starts afresh."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque()

    def update(self, total: float) -> float | None:
        """Record ``total`` now; the rate per second, or None until two readings a second apart."""
        now = self._clock()
        if self._samples and total < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, v0 = self._samples[0]
        if now - t0 < 1.0:
            return None
        return (total - v0) / (now - t0)


@dataclass(frozen=True)
class EngineView:
    up: bool
    error: str | None = None
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    prefix_hit_rate: float | None = None  # 0..1
    tokens_per_s: float | None = None
    adapters_device: int | None = None
    adapters_host: int | None = None
    adapters_registered: int | None = None  # every one, the two above included
    restarts: int | None = None

    def display(self) -> dict[str, str]:
        """Every number as the page shows it ('—' where unknown)."""
        return {
            "running": _count(self.running),
            "waiting": _count(self.waiting),
            "kv_usage": _percent(self.kv_usage),
            "kv_blocks": (
                f"{self.kv_blocks_used:,} of {self.kv_blocks_total:,} blocks"
                if self.kv_blocks_used is not None and self.kv_blocks_total is not None
                else "—"
            ),
            "prefix_hit_rate": _percent(self.prefix_hit_rate),
            "tokens_per_s": format_rate(self.tokens_per_s),
            "adapters_device": _count(self.adapters_device),
            "adapters_host": _count(self.adapters_host),
            "adapters_registered": _count(self.adapters_registered),
            "restarts": _count(self.restarts),
            "status": "running" if self.up else "down",
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "error": self.error,
            "display": self.display(),
            "kv_usage": self.kv_usage,
        }


def _count(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def format_rate(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def format_seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 1.0:
        return f"{value * 1000:.0f} ms" if value >= 0.01 else f"{value * 1000:.1f} ms"
    return f"{value:.2f} s"


class EngineMonitor:
    """Reads the engine for the Overview (``read()``), turning its cumulative token counter into
    tokens/s; without that counter, tokens/s comes from the recorder's last minute."""

    def __init__(
        self, client: EngineClient, recorder: LiveRecorder, *, timeout_s: float = 2.0
    ) -> None:
        self.client = client
        self.recorder = recorder
        self.timeout_s = timeout_s
        self.rate = CounterRate()

    async def read(self) -> EngineView:
        try:
            stats = await read_engine_stats(self.client, self.timeout_s)
        except EngineNotAnswering as exc:  # a dead engine is a state to show, not an error page
            return EngineView(up=False, error=_sentence(exc.reason))
        return self.view(stats)

    def view(self, stats: EngineStats) -> EngineView:
        generated = float(stats.num_generated_tokens)
        tokens_per_s = self.rate.update(generated)
        if tokens_per_s is None:
            tokens_per_s = self.recorder.recent_tokens_per_s()
        lora = stats.lora
        return EngineView(
            up=True,
            running=stats.num_running,
            waiting=stats.num_waiting,
            kv_usage=stats.kv_cache_usage,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            prefix_hit_rate=stats.prefix_cache_hit_rate,
            tokens_per_s=tokens_per_s,
            adapters_device=lora.resident_device if lora else None,
            adapters_host=lora.resident_host if lora else None,
            adapters_registered=lora.registered if lora else None,
            restarts=stats.engine_restarts,
        )


def _sentence(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text + "."
