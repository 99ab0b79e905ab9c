"""The adapter registry: tenants' adapters and their immutable numbered versions.

Upload, step by step (every failure leaves no file and no row behind)::

    stream the body into tmp/upload-<id>/         413 past max_adapter_bytes, 400 for pickles
    validate (worker thread, as the engine will)  400 / 413 with the validator's code
    ── registry lock ──
    row: Adapter (created if new; per-tenant limit) + AdapterVersion N, status "validating"
    files: rename into adapters/<content hash>/   (kept if that content is already stored)
    ── end lock ──
    engine: add_lora once per content hash        the version is "ready" only after this
    row: status "ready" + audit "adapter.upload"

On a failure after the row exists, the row goes (the adapter too when the upload created it,
and ``next_version`` is given back) and the files go unless another version names them.

The registry is the source of truth: versions are loaded into the engine lazily, at their first
use after a start (``ensure_loaded``: concurrent first uses load once). The engine knows an
adapter only by its content hash, so equal uploads by two tenants share one engine copy while
staying two names. Tenant-owned rows are only read through ``TenantScope``.

Replicas (``shared`` = ``--shared-state database``): several platform processes on one
database, each with its own data directory and engine. An upload's files also go into the
database (``blobs``) before the version is ready, and a replica that lacks ``adapters/<hash>/``
writes it from there before its engine loads it, so a version uploaded anywhere is served
everywhere (versions are looked up in the database on every request). When a deletion leaves
content unnamed, the same transaction drops its blobs and writes a ``content.released`` event;
every replica reads the feed every ``replica_poll_s`` (``follow_changes_forever``, started by
the platform's lifespan) and releases its engine copy and files of that content. Every
``RECONCILE_ROUNDS`` rounds it also runs ``collect_garbage``, which repairs anything a missed
event left (and prunes old events).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from loraplex.engine.client import EngineClient, EngineDeadError
from loraplex.platform import audit
from loraplex.platform.db.models import Adapter, AdapterVersion, PlatformEvent, Tenant, utcnow
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.errors import SERVER_ERROR, APIError
from loraplex.platform.model_resolver import adapter_failed
from loraplex.platform.registry import blobs
from loraplex.platform.registry.names import AdapterRef, check_adapter_name, parse_ref
from loraplex.platform.registry.records import (
    AdapterView,
    ResolvedVersion,
    adapter_not_found,
    adapter_view,
)
from loraplex.platform.registry.storage import AdapterStorage
from loraplex.platform.registry.upload import ReceivedUpload, UploadSlots
from loraplex.platform.registry.validate import (
    ValidatedAdapter,
    adapter_error,
    as_adapter_error,
    base_model_info,
    validate_upload,
)

if TYPE_CHECKING:
    from loraplex.lora.adapter import BaseModelInfo
    from loraplex.lora.errors import AdapterError
    from loraplex.platform.store import Store

logger = logging.getLogger(__name__)

T = TypeVar("T")
REGISTRY_OWNER = "registry"  # the registry's reference to an engine copy (see EngineClient)
STALE_UPLOAD_S = 600.0  # a "validating" row this old was left by a crash
RELEASED = "content.released"  # a PlatformEvent: no version names this content any more
FEED_LOOKBACK_S = 30.0  # events committed out of id order are still read within this
RECONCILE_ROUNDS = (
    60  # feed rounds between two collect_garbage runs (a minute of one-second rounds)
)
EVENT_RETENTION_S = 3600.0
MAX_DESCRIPTION = 2000
# (kind, facts, dedup_key): an adapter failed validation or failed to load (``on_failure``)
FailureListener = Callable[[str, dict[str, Any], str], None]


class Registry:
    def __init__(self, store: Store, client: EngineClient, base_name: Callable[[], str]) -> None:
        """``base_name``: the base model's name in the API (no adapter may take it)."""
        self.db = store.db
        self.settings = store.settings
        self.storage = AdapterStorage(store.data_dir)
        self.upload_slots = UploadSlots(store.settings.max_concurrent_uploads)
        self.client = client
        self.base_name = base_name
        self._lock = asyncio.Lock()  # version rows and stored files change together under it
        self._loading: dict[str, asyncio.Lock] = {}
        self._removals: set[asyncio.Task[None]] = set()  # files waiting for their engine copy
        self._base: BaseModelInfo | None = None
        self.shared = store.settings.shares_state  # files in the database, a change feed
        self._seen: dict[int, float] = {}  # feed events handled recently: id -> when
        self._failure_listeners: list[FailureListener] = []

    def on_failure(self, listener: FailureListener) -> None:
        """Call ``listener(kind, facts, dedup_key)`` when an upload fails validation
        (``adapter.validation_failed``) or the engine refuses to load it
        (``adapter.load_failed``); listeners run on the event loop and must not block. A load
        failing later, for a request, is that request's ``adapter_failed`` error."""
        self._failure_listeners.append(listener)

    def _failed(self, kind: str, facts: dict[str, Any], dedup_key: str) -> None:
        for listener in self._failure_listeners:
            try:
                listener(kind, facts, dedup_key)
            except Exception:
                logger.exception("registry: a failure listener failed on %s", kind)

    async def _db(self, fn: Callable[[Session], T]) -> T:
        return await self.db.run(fn)

    @property
    def max_lora_rank(self) -> int:
        """The engine's own limit (``EngineInfo``): uploads above it are refused."""
        return self.client.info.max_lora_rank

    def tenant_limit(self, tenant: Tenant) -> int:
        return (
            tenant.max_adapters
            if tenant.max_adapters is not None
            else self.settings.max_adapters_per_tenant
        )

    # ---- start-up ----------------------------------------------------------------------------

    def recover(self) -> None:
        """Undo what a crash interrupted: stale uploads' rows and temp files, unnamed files."""
        cutoff = utcnow() - dt.timedelta(seconds=STALE_UPLOAD_S)

        def clean(session: Session) -> list[str]:
            session.execute(
                delete(AdapterVersion).where(
                    AdapterVersion.status != "ready", AdapterVersion.created_at < cutoff
                )
            )
            empty = select(Adapter.id).where(~Adapter.versions.any())
            session.execute(delete(Adapter).where(Adapter.id.in_(empty)))
            return list(session.scalars(select(AdapterVersion.content_sha256).distinct()))

        referenced = self.db.call(clean)
        self.storage.clean_tmp()  # at start nothing is uploading: any age goes
        removed = self.storage.collect(referenced)
        if removed:
            logger.info("registry: removed %d adapter directories no version names", len(removed))

    async def collect_garbage(self) -> list[str]:
        """Remove stored files (and engine copies) no version names any more; call after rows
        went by other means (a deleted tenant). Returns the content hashes removed."""
        async with self._lock:
            referenced = set(await self._db(self._sweep))
            stale = [h for h in self.storage.stored_hashes() if h not in referenced]
            held = self.client.lora_keys(REGISTRY_OWNER)
            stale += [h for h in held if h not in referenced and h not in stale]
            await self._drop(stale)
        return stale

    def _sweep(self, session: Session) -> list[str]:
        """Every content hash a version names; shared: drop the blobs of the others (with a
        ``content.released`` event each) and events past their retention."""
        referenced = _all_hashes(session)
        if self.shared:
            names = set(referenced)
            self._released(session, [h for h in blobs.all_hashes(session) if h not in names])
            cutoff = utcnow() - dt.timedelta(seconds=EVENT_RETENTION_S)
            session.execute(delete(PlatformEvent).where(PlatformEvent.created_at < cutoff))
        return referenced

    def _released(self, session: Session, hashes: list[str]) -> None:
        """In the transaction that left ``hashes`` unnamed: their blobs go, and every replica
        is told (shared state only)."""
        if not self.shared or not hashes:
            return
        blobs.drop(session, hashes)
        session.add_all(PlatformEvent(kind=RELEASED, content_sha256=h) for h in hashes)

    # ---- the change feed (replicas) ----------------------------------------------------------

    async def follow_changes_forever(self, interval_s: float) -> None:
        """Apply other replicas' changes every ``interval_s`` (see the module docstring);
        runs until cancelled. A failed round is logged and the next one tries again."""
        last = await self._db(lambda s: s.scalar(select(func.max(PlatformEvent.id))) or 0)
        rounds = 0
        while True:
            await asyncio.sleep(interval_s)
            try:
                last = await self.apply_changes(last)
                rounds += 1
                if rounds % RECONCILE_ROUNDS == 0:
                    await self.collect_garbage()
            except Exception:
                logger.exception("registry: reading the replicas' change feed failed")

    async def apply_changes(self, last: int) -> int:
        """Handle the feed's events after ``last`` (and recent ones committed out of order);
        returns the newest id seen. Idempotent: content still named is kept."""
        since = utcnow() - dt.timedelta(seconds=FEED_LOOKBACK_S)

        def read(session: Session) -> list[tuple[int, str, str | None]]:
            query = select(PlatformEvent.id, PlatformEvent.kind, PlatformEvent.content_sha256)
            query = query.where(or_(PlatformEvent.id > last, PlatformEvent.created_at >= since))
            return [(i, k, h) for i, k, h in session.execute(query.order_by(PlatformEvent.id))]

        events = [e for e in await self._db(read) if e[0] not in self._seen]
        now = asyncio.get_running_loop().time()
        for event_id, _, _ in events:
            self._seen[event_id] = now
        for event_id in [i for i, at in self._seen.items() if at < now - 4 * FEED_LOOKBACK_S]:
            del self._seen[event_id]
        released = sorted({h for _, kind, h in events if kind == RELEASED and h})
        if released:
            async with self._lock:
                named = set(await self._db(lambda s: [h for h in released if _is_referenced(s, h)]))
                await self._drop([h for h in released if h not in named])
        return max([last, *(e[0] for e in events)])

    # ---- reads -------------------------------------------------------------------------------

    async def list_adapters(self, tenant_id: int) -> list[AdapterView]:
        def read(session: Session) -> list[AdapterView]:
            scope = TenantScope(session, tenant_id)
            name = scope.tenant().name
            query = scope.select(Adapter).options(selectinload(Adapter.versions))
            rows = session.scalars(query.order_by(Adapter.name))
            return [adapter_view(a, name) for a in rows]

        return await self._db(read)

    async def get_adapter(self, tenant_id: int, ref_text: str) -> AdapterView:
        """The adapter of ``name`` (all versions) or of ``name@N`` (that version only)."""
        ref = parse_ref(ref_text)

        def read(session: Session) -> AdapterView | None:
            if ref is None:
                return None
            scope = TenantScope(session, tenant_id)
            adapter = scope.adapter(ref.name)
            return None if adapter is None else adapter_view(adapter, scope.tenant().name)

        view = await self._db(read)
        if view is None or ref is None:
            raise adapter_not_found(ref_text)
        if ref.version is not None:
            versions = tuple(v for v in view.versions if v.number == ref.version)
            if not versions:
                raise adapter_not_found(ref_text)
            view = AdapterView(view.name, view.tenant, view.description, view.created_at, versions)
        return view

    async def find_ready(self, tenant_id: int, ref: AdapterRef) -> ResolvedVersion | None:
        """The ready version ``ref`` names in this tenant (``name``: the newest ready one)."""

        def read(session: Session) -> ResolvedVersion | None:
            scope = TenantScope(session, tenant_id)
            query = scope.select_versions().where(
                Adapter.name == ref.name, AdapterVersion.status == "ready"
            )
            if ref.version is not None:
                query = query.where(AdapterVersion.number == ref.version)
            v = session.scalars(query.order_by(AdapterVersion.number.desc()).limit(1)).first()
            if v is None:
                return None
            return ResolvedVersion(
                ref.name, v.id, v.number, v.content_sha256, v.storage_path, scope.tenant().name
            )

        return await self._db(read)

    # ---- the engine --------------------------------------------------------------------------

    async def ensure_loaded(self, key: str, storage_path: str, label: str) -> None:
        """Make sure the engine holds the stored adapter, with the registry's reference: the
        engine's own copy is what counts (another owner's, or one that survived a restart,
        is shared; a removed one is added again). Concurrent callers for one key wait for a
        single ``add_lora``. Raises what ``add_lora`` raises (``AdapterError``,
        ``EngineDeadError``)."""
        path = str(self.storage.path_of(storage_path))
        if self.client.retain_lora(key, REGISTRY_OWNER, path):
            return
        lock = self._loading.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                if self.client.retain_lora(key, REGISTRY_OWNER, path):
                    return
                if self.shared and not self.storage.has(key):
                    await self._fetch(key)  # uploaded through another replica
                info = await self.client.add_lora(label, path, owner=REGISTRY_OWNER)
                if info.key != key:
                    # The registry and the engine hash adapters with the same function; a
                    # mismatch means the files changed on disk or the versions differ.
                    await self.client.release_lora(info.key, owner=REGISTRY_OWNER)
                    raise StoredFilesError(
                        f"the engine loaded {label} as {info.key[:12]}, but the registry "
                        f"recorded {key[:12]}; the stored files at {path} changed",
                        "its stored files changed on the server",
                    )
        finally:
            if not lock.locked():
                self._loading.pop(key, None)

    async def _fetch(self, key: str) -> None:
        """Write ``adapters/<key>/`` from the database's copy (worker thread)."""

        def write(directory: Path) -> bool:
            return self.db.call(lambda s: blobs.write_out(s, key, directory))

        if not await anyio.to_thread.run_sync(lambda: self.storage.materialize(key, write)):
            raise StoredFilesError(
                f"the files of adapter {key[:12]} are neither in this replica's data directory "
                "nor in the database (uploaded before --shared-state database was on?)",
                "its files are missing on the server",
            )

    async def _share(self, key: str) -> None:
        """Copy stored content into the database for the other replicas (worker thread)."""
        directory = self.storage.root / key
        try:
            await self._db(lambda s: blobs.save(s, key, directory))
        except IntegrityError:  # saved at the same moment by another replica's upload
            if not await self._db(lambda s: blobs.stored(s, key)):
                raise

    async def load_for_request(self, version: ResolvedVersion) -> None:
        """``ensure_loaded`` for a request (called once it is admitted). The engine refusing
        what the registry validated at upload, or stored files gone or changed, is the
        adapter's fault: 422 ``adapter_failed`` naming the version as the tenant knows it;
        anything else is the server's, answered 5xx."""
        try:
            await self.ensure_loaded(
                version.content_sha256,
                version.storage_path,
                f"{version.tenant}/{version.model_id}",
            )
        except EngineDeadError:
            raise
        except StoredFilesError as exc:
            logger.warning("registry: loading %s/%s: %s", version.tenant, version.model_id, exc)
            raise adapter_failed(version.model_id, exc.cause) from None
        except ValueError as exc:  # AdapterError (a ValueError with a .code), without torch
            if as_adapter_error(exc) is None:
                raise
            logger.warning("registry: loading %s/%s: %s", version.tenant, version.model_id, exc)
            cause = "its stored files are missing or damaged on the server"
            raise adapter_failed(version.model_id, cause) from None
        except Exception as exc:
            logger.exception("registry: loading %s/%s failed", version.tenant, version.model_id)
            raise APIError(
                500,
                f"The adapter {version.model_id} could not be loaded into the engine "
                f"({type(exc).__name__}); the operator can find the cause in the server log.",
                type=SERVER_ERROR,
                code="adapter_load_failed",
            ) from None

    async def failed_loads(self) -> dict[str, str]:
        """Content hash -> why the engine's load of it failed, for adapters failed now (empty
        when the engine does not answer)."""
        try:
            stats = await self.client.stats()
        except EngineDeadError:
            return {}
        return dict(stats.lora.failed) if stats.lora is not None else {}

    async def retry(self, tenant_id: int, actor: str, name: str, number: int) -> bool:
        """Forget the engine's load failure of the tenant's version ``name@number``: its next
        request loads it again (``EngineClient.retry_lora``, on this replica's engine).
        Audited (``adapter_version.retry``). False when it had no failure; 404 when there is no
        such version."""
        ref = f"{name}@{number}"

        def read(session: Session) -> tuple[str, str] | None:
            scope = TenantScope(session, tenant_id)
            query = scope.select_versions().where(
                Adapter.name == name, AdapterVersion.number == number
            )
            version = session.scalars(query.limit(1)).first()
            return None if version is None else (version.content_sha256, scope.tenant().name)

        found = await self._db(read)
        if found is None:
            raise adapter_not_found(ref)
        key, tenant = found
        retried = await self.client.retry_lora(key)

        def log(session: Session) -> None:
            audit.record(
                session, actor, "adapter_version.retry", "adapter_version", ref,
                tenant_name=tenant, after={"had_failed": retried},
            )  # fmt: skip

        await self._db(log)
        return retried

    async def _drop(self, hashes: list[str]) -> None:
        """Release content no version names any more, and delete its files once the engine
        copy is gone (call with the lock held). A copy that requests still use is removed when
        the last of them ends; its files go then (``_remove_when_released``)."""
        for key in hashes:
            release = await self.client.release_lora(key, owner=REGISTRY_OWNER)
            if release.removed.done():
                await self._remove_files(key)
            else:
                task = asyncio.create_task(self._remove_when_released(key, release.removed))
                self._removals.add(task)
                task.add_done_callback(self._removals.discard)

    async def _remove_when_released(self, key: str, removed: asyncio.Future[bool]) -> None:
        await asyncio.shield(removed)
        async with self._lock:
            if not await self._db(lambda s: _is_referenced(s, key)):
                await self._remove_files(key)

    async def _remove_files(self, key: str) -> None:
        """Delete stored content unless the registry holds an engine copy reading it (a new
        version of the same content took it meanwhile). Call with the lock held."""
        if REGISTRY_OWNER not in self.client.lora_owners(key):
            await anyio.to_thread.run_sync(self.storage.remove, key)

    async def drain_removals(self) -> None:
        """Wait for removals that wait on running requests (tests; shutdown)."""
        while self._removals:
            await asyncio.gather(*self._removals, return_exceptions=True)

    # ---- upload ------------------------------------------------------------------------------

    async def upload(
        self, tenant_id: int, actor: str, received: ReceivedUpload, work_dir: Path
    ) -> AdapterView:
        """Register the upload in ``work_dir`` (received by ``receive_upload``) as the next
        version of its name. The caller removes ``work_dir`` afterwards, whatever happens."""
        name = check_adapter_name(received.fields.get("name", ""), self.base_name())
        description = received.fields.get("description")
        if description is not None and len(description) > MAX_DESCRIPTION:
            raise APIError(
                400,
                f"description is longer than {MAX_DESCRIPTION} characters; shorten it.",
                param="description",
                code="description_too_long",
            )
        if not received.files:
            raise APIError(
                400,
                "The upload holds no adapter file; send adapter_config.json and "
                "adapter_model.safetensors (or one .zip / .tar.gz / .tar) as file parts.",
                param="file",
                code="missing_file",
            )
        await self._db(lambda s: self._check_limit(s, tenant_id, name))  # fail before the work
        try:
            checked = await anyio.to_thread.run_sync(
                lambda: validate_upload(
                    dict(received.files),  # a copy: the thread owns it
                    work_dir,
                    self._base_sync(),
                    max_rank=self.max_lora_rank,
                    max_bytes=self.settings.max_adapter_bytes,
                )
            )
        except ValueError as exc:
            refused = as_adapter_error(exc)
            if refused is None:
                raise
            self._refused("adapter.validation_failed", tenant_id, name, refused)
            raise adapter_error(refused) from None
        self._check_targets(checked)
        # The engine's load of this content failed (its stored copy may be damaged): this
        # upload's files replace the stored ones, and the failure is forgotten before the
        # version is made ready, so its next request loads it again.
        failed = checked.content_hash in await self.failed_loads()
        async with self._lock:
            added = await self._db(
                lambda s: self._add_version(s, tenant_id, name, description, checked)
            )
            try:
                await anyio.to_thread.run_sync(
                    self.storage.store, checked.adapter_dir, checked.content_hash, work_dir, failed
                )
                if self.shared:
                    await self._share(checked.content_hash)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._undo(added)
                raise
        try:
            if failed:
                await self.client.retry_lora(checked.content_hash)
            await self.ensure_loaded(
                checked.content_hash, added.storage_path, f"{added.tenant}/{name}@{added.number}"
            )
            view = await self._db(lambda s: self._mark_ready(s, tenant_id, actor, added))
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                async with self._lock:
                    await self._undo(added)
            refused = as_adapter_error(exc) if isinstance(exc, ValueError) else None
            if refused is not None:  # the engine refused what the registry accepted
                self._refused("adapter.load_failed", tenant_id, name, refused)
                raise adapter_error(refused) from None
            raise
        return view

    def _refused(self, kind: str, tenant_id: int, name: str, refused: AdapterError) -> None:
        """An upload refused by validation, or by the engine's load: one alert per upload."""
        facts = {"tenant_id": tenant_id, "adapter": name, "code": str(refused.code),
                 "reason": refused.message[:500]}  # fmt: skip
        self._failed(kind, facts, f"{kind}:upload:{secrets.token_hex(8)}")

    def _check_targets(self, checked: ValidatedAdapter) -> None:
        """The engine says which modules it applies adapters to (``EngineInfo``)."""
        served = self.client.info.lora_target_modules
        unserved = sorted(set(checked.target_modules) - set(served))
        if unserved:
            raise APIError(
                400,
                f"The adapter was refused: LoRA on {', '.join(unserved)} is not served by this "
                f"engine, which applies adapters to {', '.join(served) or 'no module'}; retrain "
                "with target_modules among those.",
                param="file",
                code="unsupported_target",
            )

    def _base_sync(self) -> BaseModelInfo:
        """The base model's geometry (read once, in a worker thread, from its config.json)."""
        if self._base is None:
            try:
                self._base = base_model_info(self.client.info.model_dir)
            except (OSError, ValueError) as exc:
                logger.error("registry: cannot read the base model's config: %s", exc)
                raise APIError(
                    503,
                    "The server cannot check adapters now: it cannot read the base model's "
                    "config.json; tell the operator.",
                    type=SERVER_ERROR,
                    code="base_model_unreadable",
                ) from None
        return self._base

    def _check_limit(self, session: Session, tenant_id: int, name: str) -> Adapter | None:
        """The existing adapter ``name``, or None when a new one may be created (else 409)."""
        scope = TenantScope(session, tenant_id)
        adapter = scope.adapter(name)
        if adapter is not None:
            return adapter
        limit = self.tenant_limit(scope.tenant())
        count = session.scalar(select(func.count()).select_from(scope.select(Adapter).subquery()))
        if (count or 0) >= limit:
            raise APIError(
                409,
                f"This tenant already has {count} adapters, its limit ({limit}); delete one "
                "(DELETE /v1/adapters/{name}) or upload a new version of an existing name, or "
                "ask the operator to raise the limit.",
                param="name",
                code="adapter_limit_reached",
            )
        return None

    def _add_version(
        self,
        session: Session,
        tenant_id: int,
        name: str,
        description: str | None,
        checked: ValidatedAdapter,
    ) -> _Added:
        scope = TenantScope(session, tenant_id)
        adapter = self._check_limit(session, tenant_id, name)
        created = adapter is None
        if adapter is None:
            adapter = scope.add(Adapter(name=name, description=description or "", next_version=1))
            try:
                session.flush()
            except IntegrityError:  # created meanwhile by another server sharing the database
                raise APIError(
                    409,
                    f"The adapter {name!r} was created by another upload at the same moment; "
                    "send yours again to make it the next version.",
                    param="name",
                    code="adapter_conflict",
                ) from None
        elif description is not None:
            adapter.description = description
        # One UPDATE allocates the number: concurrent uploads (any server) never share one.
        session.execute(
            update(Adapter)
            .where(Adapter.id == adapter.id)
            .values(next_version=Adapter.next_version + 1)
        )
        session.refresh(adapter, ["next_version"])
        number = adapter.next_version - 1
        version = AdapterVersion(
            adapter_id=adapter.id,
            number=number,
            content_sha256=checked.content_hash,
            rank=checked.rank,
            alpha=checked.alpha,
            target_modules=list(checked.target_modules),
            size_bytes=checked.size_bytes,
            storage_path=self.storage.relative_path(checked.content_hash),
            status="validating",
        )
        session.add(version)
        session.flush()
        return _Added(
            adapter.id, version.id, number, created, version.storage_path, scope.tenant().name
        )

    def _mark_ready(
        self, session: Session, tenant_id: int, actor: str, added: _Added
    ) -> AdapterView:
        scope = TenantScope(session, tenant_id)
        version = session.scalars(
            scope.select_versions().where(AdapterVersion.id == added.version_id)
        ).first()
        if version is None:
            raise APIError(
                409,
                "The adapter was deleted while this version was being loaded; upload it again.",
                param="name",
                code="adapter_conflict",
            )
        version.status = "ready"
        session.flush()
        adapter = version.adapter
        audit.record(
            session, actor, "adapter.upload", "adapter_version", f"{adapter.name}@{version.number}",
            tenant_name=added.tenant,
            after={"adapter": adapter.name, "description": adapter.description,
                   **audit.snapshot(version)},
        )  # fmt: skip
        return adapter_view(adapter, added.tenant)

    async def _undo(self, added: _Added) -> None:
        """Remove a failed upload's row (and its adapter when the upload created it); delete
        its files unless another version names them. Call with the lock held."""

        def undo(session: Session) -> bool:
            version = session.get(AdapterVersion, added.version_id)
            content = version.content_sha256 if version is not None else None
            if version is not None:
                session.delete(version)
                session.flush()
            adapter = session.get(Adapter, added.adapter_id)
            if adapter is not None:
                if added.created and not adapter.versions:
                    session.delete(adapter)
                else:  # give the number back when nothing was numbered after it
                    session.execute(
                        update(Adapter)
                        .where(Adapter.id == adapter.id, Adapter.next_version == added.number + 1)
                        .values(next_version=added.number)
                    )
            unnamed = content is not None and not _is_referenced(session, content)
            if unnamed and self.shared:
                blobs.drop(session, [added.storage_path.rsplit("/", 1)[-1]])
            return unnamed

        content_hash = added.storage_path.rsplit("/", 1)[-1]
        if await self._db(undo):
            await self._drop([content_hash])

    # ---- delete ------------------------------------------------------------------------------

    async def delete(self, tenant_id: int, actor: str, ref_text: str) -> AdapterRef:
        """Delete the adapter ``name`` (every version) or one version ``name@N``. Deleting the
        last version deletes the adapter (its name, and its numbering, start afresh)."""
        ref = parse_ref(ref_text)
        if ref is None:
            raise adapter_not_found(ref_text)

        def remove(session: Session) -> list[str] | None:
            scope = TenantScope(session, tenant_id)
            adapter = scope.adapter(ref.name)
            if adapter is None:
                return None
            tenant = scope.tenant().name
            doomed = [v for v in adapter.versions if ref.version in (None, v.number)]
            if ref.version is not None and not doomed:
                return None
            hashes = sorted({v.content_sha256 for v in doomed})
            if ref.version is None or len(doomed) == len(adapter.versions):
                before = {
                    **audit.snapshot(adapter),
                    "versions": [v.number for v in adapter.versions],
                }
                session.delete(adapter)
                action, kind, object_id = "adapter.delete", "adapter", adapter.name
            else:
                before = {"adapter": adapter.name, **audit.snapshot(doomed[0])}
                session.delete(doomed[0])
                action, kind, object_id = "adapter_version.delete", "adapter_version", str(ref)
            session.flush()
            audit.record(session, actor, action, kind, object_id, tenant_name=tenant, before=before)
            unnamed = [h for h in hashes if not _is_referenced(session, h)]
            self._released(session, unnamed)  # other replicas unload it (the change feed)
            return unnamed

        async with self._lock:
            unreferenced = await self._db(remove)
            if unreferenced is None:
                raise adapter_not_found(ref_text)
            await self._drop(unreferenced)
        return ref


class StoredFilesError(RuntimeError):
    """A stored adapter's files are missing or are not the content the registry recorded.
    ``cause``: the same for a tenant (no path, no hash)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class _Added:
    """The rows an upload in progress added."""

    adapter_id: int
    version_id: int
    number: int
    created: bool  # the upload created the adapter
    storage_path: str
    tenant: str


def _is_referenced(session: Session, content_hash: str) -> bool:
    """Whether any version of any tenant names this content (a global, non-tenant question)."""
    query = select(AdapterVersion.id).where(AdapterVersion.content_sha256 == content_hash)
    return session.scalars(query.limit(1)).first() is not None


def _all_hashes(session: Session) -> list[str]:
    return list(session.scalars(select(AdapterVersion.content_sha256).distinct()))


def parse_tenant_id(tenant_id: Any) -> int | None:
    """The integer id in ``Caller.tenant_id`` (a string); None when it is not one."""
    try:
        return int(tenant_id)
    except (TypeError, ValueError):
        return None
