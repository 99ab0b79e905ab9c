"""The Adapters pages: every tenant's adapter versions (status, rank, targets, size, content hash,
where the engine holds each), upload through a form, and delete a version after a confirmation.

Routes::

    GET  /admin/adapters                         ?tenant=<name>&page=<n>&new=<name@N>
    GET  /admin/adapters/upload                  ?tenant=<name>
    POST /admin/adapters/upload                  multipart: csrf_token (first), tenant, name,
                                                 description, file (the two PEFT files, or one archive)
    GET  /admin/adapters/{tenant}/{name@N}/delete    POST (same path)
    POST /admin/adapters/{tenant}/{name@N}/retry     csrf_token: forget the engine's load failure

A version whose engine load failed (file missing or damaged, bad weights, no room in the pool)
shows the engine's reason and a Retry button: its next request loads it again.

Uploads and deletes go through the registry (``loraplex.platform.registry.service``), as the
admin API's do, with the actor ``admin (web)``: the same validation, storage, engine load and
audit event. The upload is streamed to disk under ``max_adapter_bytes`` by the registry's own
receiver, so its form cannot use ``FormPost`` (which would parse the whole body first); instead
the CSRF token must be the body's first part, and it is checked before a byte of a file is
written. A refused upload is shown inline in the form with the registry's message and status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from sqlalchemy import Select, func, literal, select
from sqlalchemy.orm import Session
from starlette.responses import Response

from loraplex.platform import tenants as tenant_service
from loraplex.platform.db.models import Adapter, AdapterVersion, Tenant
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.engine_state import EngineNotAnswering, read_engine_stats
from loraplex.platform.errors import APIError
from loraplex.platform.registry.names import parse_ref
from loraplex.platform.registry.service import Registry
from loraplex.platform.registry.upload import (
    boundary_of,
    check_content_length,
    receive_upload,
)
from loraplex.webui.context import (
    CSRF_FIELD,
    Admin,
    FormPost,
    NavItem,
    Refused,
    SignedIn,
    csrf_refused,
    current_session,
    redirect,
    render,
    require_writer,
    webui_of,
)
from loraplex.webui.tenant_picker import tenant_picker
from loraplex.webui.views import (
    WEB_ACTOR,
    FormErrors,
    Pager,
    fmt_bytes,
    fmt_time,
    not_found,
    page_number,
)

try:
    from python_multipart.multipart import MultipartParser, parse_options_header
except ImportError:  # python-multipart < 0.0.13 installs the module as ``multipart``
    from multipart.multipart import (  # type: ignore[no-redef]
        MultipartParser,
        parse_options_header,
    )

NAV = NavItem("Adapters", "/admin/adapters")
LIST = "/admin/adapters"
UPLOAD = "/admin/adapters/upload"
PAGE_SIZE = 50
TENANT_CHOICES = 200  # tenant names offered as suggestions in a form
STATS_TIMEOUT_S = 2.0
CSRF_PART_LIMIT = 16 * 1024  # bytes read at most to find the CSRF part at the body's start
FIELD_LIMIT = 4096
UPLOAD_FIELDS = ("tenant", "name", "description")  # the form's text fields

router = APIRouter(include_in_schema=False)


def _registry(request: Request) -> Registry:
    return webui_of(request).tenancy.registry


def list_path(tenant: str = "", **params: str) -> str:
    query = urlencode([(k, v) for k, v in {"tenant": tenant, **params}.items() if v])
    return LIST + (f"?{query}" if query else "")


def tenant_choices(session: Session, limit: int = TENANT_CHOICES) -> list[str]:
    """Tenant names for a form's suggestions (the first ``limit`` by name)."""
    return list(session.scalars(select(Tenant.name).order_by(Tenant.name).limit(limit)))


# ---- residency --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Residency:
    """Where the engine holds adapters. ``tiers``: content hash -> device | host | disk, when
    the engine reports it per adapter (stats key ``lora_residency``); otherwise only the counts
    per tier are known. ``error``: why nothing is known (the engine is down)."""

    tiers: dict[str, str] | None
    device: int | None = None
    host: int | None = None
    registered: int | None = None
    error: str | None = None
    failed: dict[str, str] = field(default_factory=dict)  # content hash -> why its load failed

    def of(self, content_hash: str, status: str) -> tuple[str, str]:
        """(word, explanation) for one version."""
        if status != "ready":
            return "—", "Only ready versions are served."
        if self.tiers is None:
            if self.error:
                return "unknown", self.error
            return "registered", (
                "Stored in the registry (disk). This engine reports how many adapters each tier "
                "holds, not which; the counts are above."
            )
        tier = self.tiers.get(content_hash)
        if tier is None:
            return "disk", "Stored in the registry; loaded into the engine at its first request."
        return tier, {
            "device": "In the device adapter pool: requests use it without loading anything.",
            "host": "In host memory: copied into the device pool when a request needs it.",
            "disk": "Registered with the engine, read from disk when a request needs it.",
        }.get(tier, "")


async def read_residency(request: Request) -> Residency:
    client = webui_of(request).platform.client
    if not client.healthy:
        return Residency(None, error="The engine is not running.")
    try:
        stats = await read_engine_stats(client, STATS_TIMEOUT_S)
    except EngineNotAnswering as exc:  # a dead or hung engine is a state to show, not an error
        return Residency(None, error=f"The engine did not report its state ({exc.reason}).")
    lora = stats.lora
    if lora is None:
        return Residency(None, error="The engine serves no adapters (LoRA is off).")
    tiers = {k: str(v) for k, v in lora.residency.items()} if lora.residency is not None else None
    failed = dict(lora.failed)
    return Residency(tiers, lora.resident_device, lora.resident_host, lora.registered, None, failed)


# ---- the list ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionRow:
    tenant: str
    adapter: str
    ref: str  # name@N
    description: str
    status: str
    error: str | None
    rank: str
    alpha: str
    targets: str
    size: str
    content_hash: str
    created: str
    resident: str = ""
    resident_note: str = ""
    failure: str = ""  # why the engine's load of it failed ("": it did not)
    is_new: bool = False


def _versions_query(session: Session, tenant_id: int | None) -> tuple[Select[Any], tuple[Any, ...]]:
    """Versions with (adapter name, description, tenant name), and their order: one tenant's
    through its ``TenantScope``, or every tenant's (the operator's view)."""
    if tenant_id is not None:
        scope = TenantScope(session, tenant_id)
        query = scope.select_versions().add_columns(
            Adapter.name, Adapter.description, literal(scope.tenant().name)
        )
        return query, (Adapter.name, AdapterVersion.number.desc())
    query = (
        select(AdapterVersion)
        .join(Adapter, AdapterVersion.adapter_id == Adapter.id)
        .join(Tenant, Adapter.tenant_id == Tenant.id)
        .add_columns(Adapter.name, Adapter.description, Tenant.name)
    )
    return query, (Tenant.name, Adapter.name, AdapterVersion.number.desc())


def _row(v: AdapterVersion, name: str, description: str, tenant: str) -> VersionRow:
    return VersionRow(
        tenant=tenant,
        adapter=name,
        ref=f"{name}@{v.number}",
        description=description,
        status=v.status,
        error=v.error,
        rank=str(v.rank),
        alpha=f"{v.alpha:g}",
        targets=", ".join(v.target_modules),
        size=fmt_bytes(v.size_bytes),
        content_hash=v.content_sha256,
        created=fmt_time(v.created_at),
    )


def _version_page(
    session: Session, tenant_id: int | None, number: int
) -> tuple[list[VersionRow], Pager]:
    """Page ``number`` (past the end: the last page) of the versions, by tenant, adapter and
    newest version first."""
    query, order = _versions_query(session, tenant_id)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    pager = Pager(number, PAGE_SIZE, int(total)).clamped()
    found = session.execute(query.order_by(*order).offset(pager.offset).limit(pager.size))
    return [_row(*r) for r in found.tuples()], pager


@router.get(LIST)
async def adapter_list(request: Request, admin: SignedIn) -> Response:
    params = request.query_params
    tenant_name = params.get("tenant", "").strip()[:64]
    new_ref = params.get("new", "")[:80]
    number = page_number(params.get("page"))

    def read(session: Session) -> tuple[list[VersionRow], Pager, str | None]:
        tenant_id = None
        if tenant_name:
            tenant = tenant_service.get_tenant(session, tenant_name)
            if tenant is None:
                return [], Pager(1, PAGE_SIZE, 0), f"There is no tenant named {tenant_name!r}."
            tenant_id = tenant.id
        rows, pager = _version_page(session, tenant_id, number)
        return rows, pager, None

    rows, pager, error = await webui_of(request).store.db.run(read)
    residency = await read_residency(request)
    shown = []
    for row in rows:
        word, note = residency.of(row.content_hash, row.status)
        is_new = row.ref == new_ref and (not tenant_name or row.tenant == tenant_name)
        failure = residency.failed.get(row.content_hash, "")
        shown.append(
            replace(row, resident=word, resident_note=note, failure=failure, is_new=is_new)
        )
    query = [("tenant", tenant_name)]
    return render(
        request,
        "adapters.html",
        admin=admin,
        title="Adapters",
        rows=shown,
        tenant=tenant_name,
        error=error,
        residency=residency,
        pager=pager,
        shown_to=pager.last_row(len(rows)),
        prev_url=pager.link(LIST, pager.number - 1, query) if pager.number > 1 else None,
        next_url=pager.link(LIST, pager.number + 1, query) if pager.number < pager.last else None,
    )


# ---- upload -----------------------------------------------------------------------------------


async def _upload_page(
    request: Request,
    admin: Admin,
    values: dict[str, str],
    errors: FormErrors | None = None,
    status: int = 200,
) -> Response:
    registry = _registry(request)
    may_act = not admin.session.read_only
    tenants = await webui_of(request).store.db.run(partial(tenant_picker, may_act=may_act))
    return render(
        request,
        "adapters_upload.html",
        admin=admin,
        status=status,
        title="Upload an adapter",
        values=values,
        errors=errors or FormErrors(),
        tenants=tenants,
        max_bytes=fmt_bytes(registry.settings.max_adapter_bytes),
        max_rank=registry.max_lora_rank,
        base_model=registry.base_name(),
    )


@router.get(UPLOAD)
async def upload_form(request: Request, admin: SignedIn) -> Response:
    tenant = request.query_params.get("tenant", "").strip()[:64]
    values = {"tenant": tenant, "name": "", "description": ""}
    return await _upload_page(request, admin, values)


class _LeadingFields:
    """``python-multipart`` callbacks recording the body's text fields up to its first file
    part (each at most ``FIELD_LIMIT`` bytes); what comes after is ignored."""

    def __init__(self) -> None:
        self.fields: list[tuple[str, str]] = []
        self.stopped = False  # a file part began (or a field was too long)
        self._name: str | None = None
        self._data = bytearray()
        self._header = bytearray()
        self._value = bytearray()
        self._disposition = b""

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
        }

    def on_part_begin(self) -> None:
        self._name, self._data, self._disposition = None, bytearray(), b""

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def on_header_end(self) -> None:
        if bytes(self._header).lower() == b"content-disposition":
            self._disposition = bytes(self._value)
        self._header, self._value = bytearray(), bytearray()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"filename" in options:
            self.stopped = True
        elif not self.stopped:
            self._name = options.get(b"name", b"").decode("utf-8", "replace")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name is not None and not self.stopped:
            self._data += data[start:end]
            if len(self._data) > FIELD_LIMIT:
                self.stopped = True

    def on_part_end(self) -> None:
        if self._name is not None and not self.stopped:
            self.fields.append((self._name, self._data.decode("utf-8", "replace")))
        self._name = None


async def _read_leading_fields(
    chunks: AsyncIterator[bytes], boundary: bytes
) -> tuple[list[tuple[str, str]], bytes]:
    """The text fields before the body's first file part (within its first ``CSRF_PART_LIMIT``
    bytes), and the bytes read, which the caller replays. Nothing is written anywhere: the
    caller checks the CSRF token (the first field) before the body goes to disk."""
    leading = _LeadingFields()
    parser = MultipartParser(boundary, leading.callbacks())  # type: ignore[arg-type]
    read = bytearray()
    try:
        async for chunk in chunks:
            room = CSRF_PART_LIMIT + 1 - len(read)
            read += chunk
            parser.write(chunk[: max(0, room)])  # never parse more than the limit
            if leading.stopped or len(read) > CSRF_PART_LIMIT:
                break
    except Exception as exc:  # a malformed body: what was recorded before it stands
        if type(exc).__module__.split(".")[0] not in ("multipart", "python_multipart"):
            raise
    return leading.fields, bytes(read)


async def _replayed(prefix: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield prefix
    async for chunk in rest:
        yield chunk


@dataclass
class StreamedForm:
    """A signed-in operator's multipart form whose leading fields (the CSRF token first) were
    read and checked; the rest of the body is still to be streamed."""

    admin: Admin
    leading: list[tuple[str, str]]
    prefix: bytes  # the bytes read so far, replayed before ``chunks``
    chunks: AsyncIterator[bytes]


async def streamed_form_admin(request: Request) -> StreamedForm:
    """The upload form's session guard (``form_admin`` would read the whole body first): a
    live session, and the CSRF token as the form's first field; else 403 before any file."""
    session = await current_session(request)
    if session is None:
        raise Refused(
            403,
            "Your session has ended",
            "You are signed out (the session expired or the server restarted), so the upload "
            "was not accepted. Sign in and upload it again.",
            action=("Sign in", "/admin/login"),
        )
    require_writer(session)  # a viewer's upload: 403 before any file
    try:
        boundary = boundary_of(request.headers.get("content-type"))
    except APIError:
        raise csrf_refused() from None  # the upload form always sends multipart/form-data
    chunks = request.stream().__aiter__()
    leading, prefix = await _read_leading_fields(chunks, boundary)
    token = leading[0][1] if leading and leading[0][0] == CSRF_FIELD else None
    if not session.csrf_matches(token):
        raise csrf_refused()
    return StreamedForm(Admin(session), leading, prefix, chunks)


@router.post(UPLOAD)
async def upload(
    request: Request, form: Annotated[StreamedForm, Depends(streamed_form_admin)]
) -> Response:
    admin, leading, prefix, chunks = form.admin, form.leading, form.prefix, form.chunks
    registry = _registry(request)
    store = webui_of(request).store
    limit = registry.settings.max_adapter_bytes
    fields = dict(reversed(leading))  # the first value of a name wins, as in the receiver
    values = {k: fields.get(k, "").strip() for k in UPLOAD_FIELDS}
    work_dir = registry.storage.new_upload_dir()
    try:
        check_content_length(request.headers, limit)
        with registry.upload_slots.hold():  # 429 when full; given back however it ends
            received = await receive_upload(
                _replayed(prefix, chunks),
                request.headers.get("content-type"),
                work_dir / "received",
                limit,
            )
            values = {k: received.fields.get(k, "").strip() for k in UPLOAD_FIELDS}
            received.fields["name"] = values["name"]
            if not values["description"]:
                received.fields.pop("description", None)  # blank: keep the adapter's description
            tenant = await store.db.run(lambda s: tenant_service.get_tenant(s, values["tenant"]))
            if tenant is None:
                raise APIError(
                    404,
                    f"There is no tenant named {values['tenant'][:64]!r}; pick one from the "
                    "list, or create the tenant first.",
                    param="tenant",
                )
            view = await registry.upload(tenant.id, WEB_ACTOR, received, work_dir)
    except APIError as exc:
        errors = FormErrors()
        errors[exc.param if exc.param in UPLOAD_FIELDS else "file"] = exc.message
        return await _upload_page(request, admin, values, errors, status=exc.status)
    finally:
        registry.storage.discard(work_dir)
    version = view.versions[-1]  # the upload's number is the adapter's highest
    ref = f"{view.name}@{version.number}"
    admin.flash("success", f"Uploaded {view.tenant}/{ref}: {version.status}.")
    return redirect(request, list_path(view.tenant, new=ref))


# ---- delete a version -------------------------------------------------------------------------


def delete_path(tenant: str, ref: str) -> str:
    return f"{LIST}/{tenant}/{ref}/delete"


async def _version_or_404(request: Request, tenant: str, ref: str) -> tuple[int, VersionRow, bool]:
    """The tenant's id, the version ``ref`` (name@N), and whether it is the adapter's last."""
    parsed = parse_ref(ref)

    def read(session: Session) -> tuple[int, VersionRow, bool] | None:
        row = tenant_service.get_tenant(session, tenant)
        if row is None or parsed is None or parsed.version is None:
            return None
        query, _ = _versions_query(session, row.id)
        found = session.execute(
            query.where(Adapter.name == parsed.name, AdapterVersion.number == parsed.version)
        ).first()
        if found is None:
            return None
        version = found[0]
        siblings = session.scalar(
            select(func.count()).where(AdapterVersion.adapter_id == version.adapter_id)
        )
        return row.id, _row(*found.tuple()), siblings == 1

    found = await webui_of(request).store.db.run(read)
    if found is None:
        raise not_found(f"{tenant[:64]} has no adapter version {ref[:80]!r}.", ("Adapters", LIST))
    return found


@router.get(LIST + "/{tenant}/{ref}/delete")
async def delete_form(request: Request, tenant: str, ref: str, admin: SignedIn) -> Response:
    _, row, last = await _version_or_404(request, tenant, ref)
    return render(
        request,
        "adapters_delete.html",
        admin=admin,
        title=f"Delete {row.ref}",
        row=row,
        last=last,
        action=delete_path(row.tenant, row.ref),
        back=list_path(row.tenant),
    )


@router.post(LIST + "/{tenant}/{ref}/delete")
async def delete_version(request: Request, tenant: str, ref: str, admin: FormPost) -> Response:
    tenant_id, row, _ = await _version_or_404(request, tenant, ref)
    try:
        await _registry(request).delete(tenant_id, WEB_ACTOR, row.ref)
    except APIError as exc:
        if exc.status != 404:
            raise
        # deleted meanwhile (another tab, the API): the same page as for any missing version
        raise not_found(
            f"{tenant[:64]} has no adapter version {ref[:80]!r}.", ("Adapters", LIST)
        ) from None
    admin.flash("success", f"Deleted {row.tenant}/{row.ref}.")
    return redirect(request, list_path(row.tenant))


# ---- retry a version whose load failed --------------------------------------------------------


def retry_path(tenant: str, ref: str) -> str:
    return f"{LIST}/{tenant}/{ref}/retry"


@router.post(LIST + "/{tenant}/{ref}/retry")
async def retry_version(request: Request, tenant: str, ref: str, admin: FormPost) -> Response:
    tenant_id, row, _ = await _version_or_404(request, tenant, ref)
    number = int(row.ref.rsplit("@", 1)[1])
    had_failed = await _registry(request).retry(tenant_id, WEB_ACTOR, row.adapter, number)
    if had_failed:
        admin.flash("success", f"{row.tenant}/{row.ref} is loaded again at its next request.")
    else:
        admin.flash("info", f"{row.tenant}/{row.ref} had no load failure; nothing changed.")
    return redirect(request, list_path(row.tenant))
