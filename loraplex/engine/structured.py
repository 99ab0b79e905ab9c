"""Structured output in the engine: constraints compiled off the step, one matcher per
constrained request, a token bitmask per sampling row each step, matchers advanced after.

Owned by ``EngineCore``. A request with a constraint is held here (not in the scheduler) until
its grammar is compiled by a worker thread (cached by ``constraint.key()``), then handed to the
scheduler with a fresh matcher; the steps of every other request go on meanwhile. Compiles
queue per tenant in front of the threads (``FairExecutor``: round robin, and no tenant holds
every thread), and the cache is bounded in entries and bytes (``CACHE_SIZE``,
``CACHE_BYTES``: a grammar weighs what its compile allocated). A grammar whose matcher hits a
limit of the grammar library mid-generation leaves the cache (its shared lexer state is spent:
every later copy would fail at once). The
scheduler sees this component only through ``TokenConstraints`` (``advance`` / ``rollback`` /
``forget``), so it stays free of grammar code.

Matcher invariant: a running request's matcher has consumed exactly its output tokens (a token
that ends the request, EOS or a stop token id, is not fed to it). Preemption recomputes KV and
keeps the output tokens, so the matcher stays as it is; ``Scheduler.rollback`` rolls it back.
Errors never leave this component as exceptions of the step: a grammar that fails to compile,
or a matcher that fails while filling a mask, ends only its own request (finish_reason
"error", with the message in ``EngineCoreOutput.error``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from loraplex.engine.records import SchedulerOutput
from loraplex.engine.request import Request
from loraplex.grammar import (
    CACHE_BYTES,
    CACHE_SIZE,
    CompiledGrammar,
    FairExecutor,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    grammar_bytes,
)
from loraplex.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # one tenant's slow schema holds one; the other serves the other tenants
IDLE_WAIT = 0.05  # seconds a step with nothing to run waits for a compile to finish
# Mask work as tenant work (fill_masks): a step whose masks took longer than this is followed
# by steps that time each row; a row over MASK_ROW_LIMIT_S for MASK_STRIKES steps in a row ends
# its request. Honest constraints take a small fraction of that a row (python -m
# benchmarks.structured); the bound is about a decode step's whole budget on two cores.
CHEAP_MASKS_S = 0.005
MASK_ROW_LIMIT_S = 0.02
MASK_STRIKES = 3
# The fair policy charges a second of mask work as this many tokens of service: about what a
# decode row of SmolLM2 at batch 32 costs of a step on two cores (loraplex bench throughput).
MASK_TOKENS_PER_SECOND = 500.0


class ConstraintTooCostly(GrammarError):
    """A request's constraint costs more mask work per token than the engine's bound: the
    client's fault (``error_code``), the request ends."""

    code = "constraint_too_costly"


@dataclass
class _Waiting:
    request: Request
    future: Future[CompiledGrammar]


class StructuredOutputs:
    """The engine's structured-output component. ``backend_factory`` builds the grammar backend
    (on a worker thread, at the first constrained request: building a tokenizer's index takes
    about half a second); ``GrammarError`` from it fails the constrained requests only."""

    def __init__(
        self,
        backend_factory: Callable[[], GrammarBackend],
        *,
        threads: int = COMPILE_THREADS,
        cache_size: int = CACHE_SIZE,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self._factory = backend_factory
        self._backend: GrammarBackend | GrammarError | None = None
        self._backend_lock = threading.Lock()
        self._threads = threads
        self._executor: FairExecutor | None = None
        # constraint key -> its compile (done or running); LRU over finished ones, bounded by
        # cache_size entries and cache_bytes (``_weight``: running compiles weigh their key)
        self._compiled: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._waiting: dict[str, _Waiting] = {}  # request id -> held until its grammar is ready
        self._matchers: dict[str, GrammarMatcher] = {}  # request id -> its matcher
        self._keys: dict[str, str] = {}  # request id -> its constraint's key (running ones)
        self._failed: dict[str, str] = {}  # request id -> why its matcher failed in a mask fill
        self._tenants: dict[str, str | None] = {}  # request id -> its tenant (mask charges)
        self._strikes: dict[str, int] = {}  # request id -> steps in a row over the mask bound
        self._costly: set[str] = set()  # requests failed for their mask work (client's fault)
        self._timed_rows = False  # the last masks were costly: time each row (fill_masks)
        # told the mask seconds of each tenant's rows every step (the fair policy's charge)
        self.on_mask_cost: Callable[[str | None, float], None] | None = None
        self.num_compiles = 0
        self.compile_seconds = 0.0  # total, in the worker threads

    def wrap_backend(self, wrap: Callable[[GrammarBackend], GrammarBackend]) -> None:
        """Put ``wrap`` around the backend when it is built (benchmarks' and tests' hooks:
        a held compile, injected faults). Only before the first constrained request."""
        if self._backend is not None:
            raise RuntimeError("the grammar backend is built already; wrap it before first use")
        factory = self._factory
        self._factory = lambda: wrap(factory())

    # ---- compiling -------------------------------------------------------------------------

    def _pool(self) -> FairExecutor:
        if self._executor is None:
            self._executor = FairExecutor(self._threads, "loraplex-grammar")
        return self._executor

    def _backend_now(self) -> GrammarBackend:
        """The backend, built by the first caller (a compile thread); ``GrammarError`` from
        the factory is kept and raised to every later caller."""
        with self._backend_lock:
            if self._backend is None:
                try:
                    self._backend = self._factory()
                except GrammarError as exc:
                    self._backend = exc
            backend = self._backend
        if isinstance(backend, GrammarError):
            raise GrammarError(str(backend))
        return backend

    def _compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            return self._backend_now().compile(constraint)
        finally:
            self.num_compiles += 1
            self.compile_seconds += time.perf_counter() - start

    def compile_async(
        self, constraint: StructuredOutputsParams, tenant: Hashable = None
    ) -> Future[CompiledGrammar]:
        """The compile of ``constraint``: cached, or queued now in ``tenant``'s line."""
        key = constraint.key()
        future = self._compiled.get(key)
        if future is not None and (not future.done() or _kept(future)):
            self._compiled.move_to_end(key)
            return future
        # A failure other than GrammarError (a backend bug, a resource error) is not kept:
        # the next request with this constraint compiles it again.
        future = self._pool().submit(tenant, self._compile, constraint)
        self._compiled[key] = future
        self._evict()
        return future

    @property
    def cache_nbytes(self) -> int:
        """What the cached compiles weigh now (see ``_weight``)."""
        return sum(_weight(k, f) for k, f in self._compiled.items())

    def _evict(self) -> None:
        """Least recently used finished compiles out while over either bound (running ones
        stay: a request waits on them)."""
        total = self.cache_nbytes
        for key, future in list(self._compiled.items()):
            if len(self._compiled) <= self.cache_size and total <= self.cache_bytes:
                break
            if not future.done() or len(self._compiled) == 1:
                continue
            total -= _weight(key, future)
            del self._compiled[key]

    def forget_grammar(self, key: str) -> None:
        """Drop ``key``'s compiled grammar (its matchers hit a limit of the grammar library:
        the lexer state they share is spent), so the next request compiles it afresh."""
        future = self._compiled.get(key)
        if future is not None and future.done():
            del self._compiled[key]

    def check(self, constraint: StructuredOutputsParams) -> None:
        """Compile now and wait (the offline API validates before it runs anything);
        ``GrammarError`` when the constraint cannot be enforced."""
        try:
            self.compile_async(constraint).result()
            self._evict()
        except GrammarError:
            self._evict()
            raise
        except Exception as exc:
            raise GrammarError(_failure(exc)) from exc

    # ---- requests in ---------------------------------------------------------------------

    def admit(self, req: Request) -> bool:
        """True when ``req`` may go to the scheduler now (no constraint, or its grammar is
        compiled: its matcher is made). Otherwise it waits here for ``take_ready``."""
        constraint = req.params.structured_outputs
        if constraint is None:
            return True
        if req.request_id in self._waiting:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        future = self.compile_async(constraint, req.tenant)
        if future.done() and not future.cancelled() and future.exception() is None:
            self._matchers[req.request_id] = future.result().matcher()
            self._keys[req.request_id] = constraint.key()
            self._tenants[req.request_id] = req.tenant
            return True
        if req.queued_time is None:
            req.queued_time = time.monotonic()  # the compile wait is queue time too
        self._waiting[req.request_id] = _Waiting(req, future)
        return False

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The held requests whose grammar is ready (matchers made), in arrival order, and
        those whose compile failed, each with the message for its client."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        if not self._waiting:
            return ready, failed
        for rid, w in list(self._waiting.items()):
            if not w.future.done():
                continue
            del self._waiting[rid]
            if not ready and not failed:
                self._evict()  # a compile finished: its weight is known now
            if w.future.cancelled():  # the engine is shutting down
                failed.append((w.request, "the engine stopped before the grammar compiled"))
                continue
            exc = w.future.exception()
            if exc is None:
                try:
                    self._matchers[rid] = w.future.result().matcher()
                except Exception as e:
                    failed.append((w.request, _failure(e)))
                    continue
                constraint = w.request.params.structured_outputs
                if constraint is not None:
                    self._keys[rid] = constraint.key()
                self._tenants[rid] = w.request.tenant
                ready.append(w.request)
            else:
                failed.append((w.request, _failure(exc)))
        return ready, failed

    def abort(self, request_ids: list[str]) -> list[str]:
        """Drop the held requests among ``request_ids``; returns the others (the scheduler's)."""
        rest = []
        for rid in request_ids:
            if self._waiting.pop(rid, None) is None:
                rest.append(rid)
        return rest

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def is_waiting(self, request_id: str) -> bool:
        """Whether the request waits here for its grammar."""
        return request_id in self._waiting

    def waiting_requests(self) -> Iterator[Request]:
        return (w.request for w in self._waiting.values())

    def wait(self, timeout: float = IDLE_WAIT) -> None:
        """Block until a held request's compile finishes, at most ``timeout`` seconds (a step
        with nothing else to do calls it, so the engine loop does not spin)."""
        pending = {w.future for w in self._waiting.values()}
        if pending:
            cf.wait(pending, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    # ---- each step -----------------------------------------------------------------------

    def fill_masks(self, out: SchedulerOutput) -> None:
        """Put the allowed-token bitmask of every constrained sampling row (forks under their
        own ids) into ``out.token_masks``, and charge the mask time to the rows' tenants.

        Masks are tenant work (issue 31): the batch fill is timed; a batch that took longer
        than ``CHEAP_MASKS_S`` makes the next steps fill row by row, each row timed, so that a
        costly row is charged to its own tenant (``on_mask_cost``) and not spread over the
        others, until a step's masks are cheap again. A row over ``MASK_ROW_LIMIT_S`` for
        ``MASK_STRIKES`` steps in a row ends its request with the reason."""
        if not self._matchers:  # no constrained request running: the step pays nothing
            return
        ids = [s.request_id for s in out.requests if s.sample and s.params.structured_outputs]
        ids += [f.request_id for f in out.forks if f.params.structured_outputs]
        rows = [(self._matchers[rid], rid) for rid in ids if rid in self._matchers]
        if not rows:
            return
        backend = self._backend_now()
        words = -(-backend.vocab_size // 32)
        bitmask = np.zeros((len(rows), words), dtype=np.int32)  # [R, ceil(V / 32)]
        pairs = [(m, i) for i, (m, _) in enumerate(rows)]
        seconds = self._fill_timed(pairs, rows, bitmask) if self._timed_rows else None
        if seconds is None:
            start = time.perf_counter()
            try:
                backend.fill_bitmasks(pairs, bitmask)
            except Exception:  # find the matcher that failed; the others keep their masks
                for m, i in pairs:
                    try:
                        m.fill_bitmask(bitmask, i)
                    except Exception as exc:
                        self._failed[rows[i][1]] = _failure(exc)
            took = time.perf_counter() - start
            self._timed_rows = took > CHEAP_MASKS_S
            # cheap: shared evenly; costly: not known whose, the next steps time each row
            seconds = None if self._timed_rows else [took / len(rows)] * len(rows)
        if seconds is not None:
            self._charge(rows, seconds)
        for i, (m, rid) in enumerate(rows):
            if rid in self._failed:
                self._spent(rid)
                continue
            why = m.error
            if why is not None or not bitmask[i].any():
                self._failed[rid] = why or "the grammar allows no token here"
                self._spent(rid)
                continue
            out.token_masks[rid] = bitmask[i]

    def _fill_timed(
        self,
        pairs: list[tuple[GrammarMatcher, int]],
        rows: list[tuple[GrammarMatcher, str]],
        bitmask: np.ndarray,
    ) -> list[float]:
        """Fill row by row, timing each; a row over the limit too many steps in a row fails."""
        seconds: list[float] = []
        for m, i in pairs:
            rid = rows[i][1]
            start = time.perf_counter()
            try:
                m.fill_bitmask(bitmask, i)
            except Exception as exc:
                self._failed[rid] = _failure(exc)
            took = time.perf_counter() - start
            seconds.append(took)
            if took <= MASK_ROW_LIMIT_S:
                self._strikes.pop(rid, None)
                continue
            strikes = self._strikes[rid] = self._strikes.get(rid, 0) + 1
            if strikes >= MASK_STRIKES and rid not in self._failed:
                self._costly.add(rid)
                self._failed[rid] = (
                    f"its output constraint takes {took * 1000:.0f} ms of work per token to "
                    f"enforce, over the engine's bound of {MASK_ROW_LIMIT_S * 1000:.0f} ms; "
                    "simplify the schema, pattern or grammar"
                )
        self._timed_rows = sum(seconds) > CHEAP_MASKS_S
        return seconds

    def _charge(self, rows: list[tuple[GrammarMatcher, str]], seconds: list[float]) -> None:
        if self.on_mask_cost is None:
            return
        per: dict[str | None, float] = {}
        for (_, rid), took in zip(rows, seconds, strict=True):
            tenant = self._tenants.get(rid)
            per[tenant] = per.get(tenant, 0.0) + took
        for tenant, took in per.items():
            self.on_mask_cost(tenant, took)

    def _spent(self, request_id: str) -> None:
        """``request_id``'s matcher failed: its grammar leaves the cache (see the module)."""
        key = self._keys.get(request_id)
        if key is not None:
            self.forget_grammar(key)

    # ---- TokenConstraints: what the scheduler calls --------------------------------------

    def advance(self, req: Request, token_id: int) -> bool:
        """``req`` generated ``token_id`` (already appended): True when its constraint is
        complete. Raises ``GrammarError`` when the token is refused or the matcher failed."""
        rid = req.request_id
        why = self._failed.pop(rid, None)
        if why is not None:
            if rid in self._costly:
                raise ConstraintTooCostly(why)
            raise GrammarError(why)
        matcher = self._matchers.get(rid)
        if matcher is None:
            raise GrammarError("the request's grammar matcher is missing (an engine bug)")
        if token_id in req.eos_token_ids and matcher.is_accepting():
            return True  # EOS where the grammar may end (an ignore_eos request)
        if not matcher.accept_token(token_id):
            self._spent(rid)
            raise GrammarError(
                f"the grammar refused token {token_id}: {matcher.error or 'not allowed here'}"
            )
        return bool(matcher.is_terminated())

    def rollback(self, req: Request, num_tokens: int) -> None:
        """``req`` forgets its last ``num_tokens`` output tokens."""
        matcher = self._matchers.get(req.request_id)
        if matcher is not None and num_tokens > 0:
            matcher.rollback(num_tokens)
        self._failed.pop(req.request_id, None)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted."""
        self._matchers.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._failed.pop(request_id, None)
        self._waiting.pop(request_id, None)
        self._tenants.pop(request_id, None)
        self._strikes.pop(request_id, None)
        self._costly.discard(request_id)

    def has_matcher(self, request_id: str) -> bool:
        return request_id in self._matchers

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(cancel=True)


def _kept(future: Future[CompiledGrammar]) -> bool:
    """Whether a finished compile stays cached: a success, or a ``GrammarError`` (the same
    constraint fails the same way). A backend failure or a cancelled compile is tried again."""
    if future.cancelled():
        return False
    exc = future.exception()
    return exc is None or isinstance(exc, GrammarError)


def _weight(key: str, future: Future[CompiledGrammar]) -> int:
    """A cache entry's bytes: its key, and its grammar (``grammar_bytes``) or refusal."""
    if not future.done() or future.cancelled():
        return len(key)
    exc = future.exception()
    if exc is not None:
        return len(key) + len(str(exc))
    return len(key) + grammar_bytes(future.result())


def _failure(exc: BaseException) -> str:
    if isinstance(exc, GrammarError):
        return str(exc)
    return f"the structured-output backend failed: {type(exc).__name__}: {exc}"
