"""What every admin page shares: the web UI's state, who is signed in, CSRF checks, rendering,
relative redirects and the navigation.

A page is a FastAPI route that depends on one of:

* ``SignedIn`` (``page_admin``): a signed-in operator, else a redirect to the sign-in page
  (with ``next`` = here);
* ``FormPost`` (``form_admin``): the same for a POST, whose form must carry the session's CSRF
  token, else 403 before the route runs;
* ``Polling`` (``json_admin``): for the scripts' JSON and fragments, else 401 (JSON).

Only the session cookie signs an operator in: ``Authorization`` headers (tenant keys, even the
admin token) are ignored here, so no API key opens a page. Every URL the UI emits is a path
(``root_path`` + ``/admin/...``), never scheme or host, so it works behind a reverse proxy and
under a path prefix.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar, cast
from urllib.parse import urlencode

import jinja2
from fastapi import Depends, Request
from markupsafe import Markup
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.datastructures import FormData
from starlette.responses import HTMLResponse, RedirectResponse, Response

from loraplex.platform.components import Platform, Tenancy
from loraplex.platform.errors import INVALID_REQUEST, APIError
from loraplex.platform.store import Store
from loraplex.webui.credentials import credential_version
from loraplex.webui.live import EngineMonitor, LiveRecorder
from loraplex.webui.oidc import OIDCClient
from loraplex.webui.sessions import (
    FlashLevel,
    LoginThrottle,
    OneTimeSecrets,
    Session,
    SessionBackend,
)

PACKAGE_DIR = Path(__file__).parent
TEMPLATES_DIR = PACKAGE_DIR / "templates"
STATIC_DIR = PACKAGE_DIR / "static"

SESSION_COOKIE = "lpx_admin_session"
LOGIN_COOKIE = "lpx_admin_login"  # the sign-in form's CSRF token (double submit)
CSRF_FIELD = "csrf_token"
HOME = "/admin"

# Pages: same-origin everything, nothing inline but SVG markup, no framing.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class WebUISettings(BaseSettings):
    """Settings of the admin UI; environment variables ``LORAPLEX_WEBUI_<NAME>`` override them."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_WEBUI_", extra="ignore", frozen=True)

    trust_proxy_headers: bool = Field(
        False,
        description="take the client address and scheme from X-Forwarded-For/-Proto "
        "(only behind a reverse proxy that sets them)",
    )
    session_idle_minutes: int = Field(8 * 60, ge=1, le=7 * 24 * 60)
    session_max_hours: int = Field(24, ge=1, le=30 * 24)
    login_max_failures: int = Field(5, ge=1, le=1000)
    login_window_seconds: int = Field(300, ge=1, le=24 * 3600)
    refresh_seconds: float = Field(2.0, ge=0.5, le=60.0)


@dataclass(frozen=True)
class NavItem:
    label: str
    path: str  # below the root path: "/admin/tenants"

    def active_for(self, route_path: str) -> bool:
        if self.path == HOME:
            return route_path in (HOME, HOME + "/")
        return route_path == self.path or route_path.startswith(self.path + "/")


@dataclass
class WebUI:
    """The admin UI's state (``loraplex.server.LoraplexApp.webui``): the platform it manages,
    its own settings, sessions and sign-in throttle, the live charts' recorder and the engine
    monitor, the templates, the navigation, and the new keys' secrets shown once."""

    platform: Platform
    settings: WebUISettings
    sessions: SessionBackend  # memory, or the database's (replicas)
    throttle: LoginThrottle
    recorder: LiveRecorder
    monitor: EngineMonitor
    templates: jinja2.Environment
    nav: list[NavItem]
    static_versions: dict[str, str]
    new_keys: OneTimeSecrets = field(default_factory=OneTimeSecrets)
    sso: OIDCClient | None = None  # single sign-on (``LORAPLEX_SSO_*``); None: off

    @property
    def tenancy(self) -> Tenancy:
        assert self.platform.tenancy is not None, "the admin UI runs on the platform only"
        return self.platform.tenancy

    @property
    def store(self) -> Store:
        return self.tenancy.store


class HasWebUI(Protocol):
    """The application: ``loraplex.server.LoraplexApp``."""

    webui: WebUI | None


def webui_of(request: Request) -> WebUI:
    webui = cast(HasWebUI, request.app).webui
    assert webui is not None, "the admin UI's routes are mounted only with the UI"
    return webui


def make_templates() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def static_versions() -> dict[str, str]:
    """A content hash per static file, appended to its URL so browsers never use a stale copy."""
    return {
        path.relative_to(STATIC_DIR).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        for path in sorted(STATIC_DIR.rglob("*"))
        if path.is_file()
    }


# ---- the request: paths, client, scheme ------------------------------------------------------


def root_path(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def route_path(request: Request) -> str:
    """The request's path below the root path (Starlette puts the root path into ``path``)."""
    path = str(request.scope["path"])
    root = root_path(request)
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return path or "/"


def url_for_path(request: Request, path: str) -> str:
    """The URL of ``path`` (below the root path) as this request reached the server: a path."""
    return root_path(request) + path


def client_address(request: Request) -> str:
    if webui_of(request).settings.trust_proxy_headers:
        forwarded = request.headers.get("x-forwarded-for", "")
        hop = forwarded.split(",")[-1].strip()  # the address our proxy saw
        if hop:
            return hop[:64]
    return request.client.host if request.client is not None else "unknown"


def is_https(request: Request) -> bool:
    if request.scope.get("scheme") == "https":
        return True
    if webui_of(request).settings.trust_proxy_headers:
        proto = request.headers.get("x-forwarded-proto", "").split(",")[-1].strip().lower()
        return proto == "https"
    return False


# Where a sign-in may send the operator afterwards: an admin page of this site, as a path.
_SAFE_NEXT = re.compile(r"/admin(?:[/?][\x21-\x7e]*)?")


def safe_next(value: str | None) -> str:
    """``value`` when it is a path to an admin page, else the Overview: never another site."""
    if (
        not value
        or len(value) > 2000
        or not _SAFE_NEXT.fullmatch(value)
        or "\\" in value
        or "//" in value
        or "/." in value.split("?", 1)[0]
    ):
        return HOME
    return value


def login_query(next_path: str, *, expired: bool) -> str:
    """The query of the sign-in page's URL that comes back to ``next_path`` afterwards."""
    params = {"next": safe_next(next_path)}
    if expired:
        params["notice"] = "expired"
    return urlencode(params)


# ---- responses -------------------------------------------------------------------------------


R = TypeVar("R", bound=Response)


def secure_headers(response: R) -> R:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def redirect(request: Request, path: str, status: int = 303) -> Response:
    """A redirect to ``path`` (below the root path); the Location header is a path, no host."""
    response = RedirectResponse(url_for_path(request, path), status_code=status)
    return secure_headers(response)


def set_cookie(
    request: Request,
    response: Response,
    name: str,
    value: str,
    path: str = HOME,
    *,
    samesite: Literal["strict", "lax"] = "strict",
    max_age: int | None = None,
) -> None:
    """HttpOnly, Secure over TLS; Lax only where a cross-site redirect must carry it (single
    sign-on comes back from the provider's site)."""
    response.set_cookie(
        name,
        value,
        path=url_for_path(request, path),
        max_age=max_age,
        httponly=True,
        samesite=samesite,
        secure=is_https(request),
    )


def delete_cookie(request: Request, response: Response, name: str, path: str = HOME) -> None:
    response.delete_cookie(
        name,
        path=url_for_path(request, path),
        httponly=True,
        samesite="strict",
        secure=is_https(request),
    )


def render(
    request: Request,
    template: str,
    *,
    admin: Admin | None = None,
    status: int = 200,
    headers: dict[str, str] | None = None,
    **context: Any,
) -> HTMLResponse:
    """``template`` inside the layout (with the navigation when ``admin`` is signed in)."""
    webui = webui_of(request)
    here = route_path(request)
    csrf_token = admin.session.csrf_token if admin is not None else ""

    def url(path: str) -> str:
        return url_for_path(request, path)

    def static(name: str) -> str:
        version = webui.static_versions.get(name, "0")
        return url(f"/admin/static/{name}?v={version}")

    values: dict[str, Any] = {
        "url": url,
        "static": static,
        "here": here,
        "admin": admin,
        "csrf_token": csrf_token,
        "csrf_field": CSRF_FIELD,
        "csrf_input": Markup('<input type="hidden" name="{}" value="{}">').format(
            CSRF_FIELD, csrf_token
        ),
        "nav": [(item, item.active_for(here)) for item in webui.nav] if admin else [],
        "read_only": admin is not None and admin.session.read_only,
        "sso_user": admin.session.sso if admin is not None else None,
        "flashes": admin.session.pop_flashes() if admin is not None else [],
        "refresh_ms": int(webui.settings.refresh_seconds * 1000),
        "refresh_seconds": f"{webui.settings.refresh_seconds:g}",
    }
    values.update(context)
    html = webui.templates.get_template(template).render(values)
    response = HTMLResponse(html, status_code=status, headers=headers)
    return secure_headers(response)


# ---- who is signed in ------------------------------------------------------------------------


@dataclass
class Admin:
    """The signed-in operator of one request (``form``: the POST's fields, CSRF-checked)."""

    session: Session
    form: FormData | None = None

    def flash(self, level: FlashLevel, message: str) -> None:
        self.session.flash(level, message)

    def field(self, name: str, default: str = "") -> str:
        """A text field of the form ('' for a missing one, an upload never)."""
        value = self.form.get(name) if self.form is not None else None
        return value if isinstance(value, str) else default


class LoginRequired(Exception):
    """No signed-in operator: answered with a redirect to the sign-in page."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


class Refused(Exception):
    """A request the UI turns down with an HTML page saying why and what to do."""

    def __init__(
        self,
        status: int,
        title: str,
        message: str,
        *,
        headers: dict[str, str] | None = None,
        action: tuple[str, str] | None = None,  # (label, path) of the way forward
    ) -> None:
        super().__init__(message)
        self.status = status
        self.title = title
        self.message = message
        self.headers = headers
        self.action = action


CREDENTIAL_RECHECK_S = 10.0  # how stale a session's view of the admin token may be


async def current_session(request: Request) -> Session | None:
    """The live session of the request's cookie; None when there is none, it expired, or the
    admin token changed since it signed in (then it is dropped)."""
    session_id = request.cookies.get(SESSION_COOKIE)
    webui = webui_of(request)
    session = await webui.sessions.load(session_id)
    if session is None:
        return None
    identity = session.sso
    if identity is not None:  # single sign-on: valid while its configuration is unchanged
        sso = webui.sso
        if sso is None or identity.fingerprint != sso.settings.fingerprint():
            await webui.sessions.end(session_id)
            return None
        return session
    now = webui.sessions.now()
    if now - session.verified_at >= CREDENTIAL_RECHECK_S:
        store = webui.store
        version = await store.db.run(lambda s: credential_version(store, s))
        if version != session.credential_version:
            await webui.sessions.end(session_id)
            return None
        session.verified_at = now
    return session


def _here_with_query(request: Request) -> str:
    query = request.scope.get("query_string", b"").decode("latin-1")
    return route_path(request) + (f"?{query}" if query else "")


async def page_admin(request: Request) -> Admin:
    """Dependency of a page (GET): the signed-in operator, else a redirect to sign in."""
    session = await current_session(request)
    if session is None:
        raise LoginRequired(_here_with_query(request))
    return Admin(session)


def csrf_refused() -> Refused:
    return Refused(
        403,
        "This form was refused",
        "The form did not carry a valid security token: it has expired, was opened in an older "
        "session, or was sent from another site. Go back, reload the page and submit it again.",
        action=("Go to the overview", HOME),
    )


def read_only_refused() -> Refused:
    return Refused(
        403,
        "Your role is read-only",
        "You are signed in with the viewer role, which can open every page but change "
        "nothing. Ask an operator to make this change, or to give your account the operator "
        "role in the identity provider.",
        action=("Go to the overview", HOME),
    )


def require_writer(session: Session) -> None:
    """Refuse (403) a write by a viewer; every form that changes something calls this."""
    if session.read_only:
        raise read_only_refused()


async def form_admin(request: Request) -> Admin:
    """Dependency of a form POST that changes something: a signed-in operator (not a viewer)
    whose form carries the session's CSRF token; anything else is refused with 403 before the
    route runs."""
    admin = await form_session(request)
    require_writer(admin.session)
    return admin


async def form_session(request: Request) -> Admin:
    """Dependency of a form POST any signed-in role may send (signing out): the session's CSRF
    token is checked, the role is not."""
    session = await current_session(request)
    if session is None:
        raise Refused(
            403,
            "Your session has ended",
            "You are signed out (the session expired or the server restarted), so this form "
            "was not accepted. Sign in and submit it again.",
            action=("Sign in", "/admin/login"),
        )
    form = await request.form()
    token = form.get(CSRF_FIELD)
    if not session.csrf_matches(token if isinstance(token, str) else None):
        raise csrf_refused()
    return Admin(session, form)


async def json_admin(request: Request) -> Admin:
    """Dependency of a JSON endpoint the pages' scripts poll: 401 (JSON) without a session."""
    session = await current_session(request)
    if session is None:
        raise APIError(
            401,
            "Not signed in to the admin UI (the session expired or the server restarted); "
            "reload the page and sign in.",
            type=INVALID_REQUEST,
            code="admin_session_required",
        )
    return Admin(session)


# For routes: ``admin: SignedIn`` (a page), ``admin: FormPost`` (a form's POST), ``admin: Polling``
# (a script's JSON or fragment).
SignedIn = Annotated[Admin, Depends(page_admin)]
FormPost = Annotated[Admin, Depends(form_admin)]
SessionPost = Annotated[Admin, Depends(form_session)]  # any role: signing out
Polling = Annotated[Admin, Depends(json_admin)]
