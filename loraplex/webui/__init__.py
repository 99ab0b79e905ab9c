"""The admin web UI: server-rendered pages under ``/admin`` (JSON admin API: ``/admin/api``).

``build_webui(platform)`` makes the UI's state (the application holds it), ``attach_webui(app)``
adds its error pages and static files (``/admin/static``), and the application mounts
``ROUTERS`` (the pages) with the rest of its routes. Pages are listed once, in ``PAGES``: each module there has a
``router`` and a ``NAV`` item (or None), and the navigation is built from that list, so a new
page is one module plus one line here.
"""

from __future__ import annotations

import inspect
import logging
from types import ModuleType
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from loraplex.platform import access
from loraplex.platform.access import Audience
from loraplex.platform.components import Platform
from loraplex.webui import (
    adapters,
    audit,
    budgets,
    context,
    keys,
    login,
    overview,
    playground,
    requests,
    sso,
    tenants,
    usage,
    webhooks,
)
from loraplex.webui.context import (
    STATIC_DIR,
    Admin,
    LoginRequired,
    NavItem,
    Refused,
    WebUI,
    WebUISettings,
    make_templates,
    redirect,
    render,
    route_path,
    static_versions,
)
from loraplex.webui.live import EngineMonitor, LiveRecorder
from loraplex.webui.oidc import OIDCClient, SSOSettings
from loraplex.webui.sessions import (
    DatabaseSessionStore,
    LoginThrottle,
    SessionBackend,
    SessionStore,
)

__all__ = [
    "PAGES",
    "ROUTERS",
    "SESSION_GUARDS",
    "WebUI",
    "WebUISettings",
    "attach_webui",
    "build_webui",
    "load_webui_settings",
]

logger = logging.getLogger(__name__)

PAGES: tuple[ModuleType, ...] = (
    overview,
    tenants,
    keys,
    adapters,
    usage,
    requests,
    audit,
    playground,
    budgets,
    webhooks,
)  # in navigation order


def load_webui_settings(**overrides: Any) -> WebUISettings:
    """Settings from the environment (``LORAPLEX_WEBUI_*``), then ``overrides``."""
    return WebUISettings(**overrides)


def build_webui(
    platform: Platform,
    settings: WebUISettings | None = None,
    sso_settings: SSOSettings | None = None,
) -> WebUI:
    """The admin UI's state for ``platform`` (which must run the multi-tenant platform).
    ``webui.recorder.observe_record`` is a request-log observer feeding the Overview's charts:
    the application adds it to the request log's observers. ``sso_settings``: single sign-on (default:
    ``LORAPLEX_SSO_*`` from the environment; off without an issuer)."""
    if platform.tenancy is None:
        raise ValueError("the admin UI manages the multi-tenant platform; build it with a Store")
    settings = settings or load_webui_settings()
    sso_settings = sso_settings or SSOSettings()
    recorder = LiveRecorder()
    nav: list[NavItem] = [page.NAV for page in PAGES if getattr(page, "NAV", None) is not None]
    return WebUI(
        platform=platform,
        settings=settings,
        sessions=_session_store(platform, settings),
        throttle=LoginThrottle(
            max_failures=settings.login_max_failures, window_s=settings.login_window_seconds
        ),
        recorder=recorder,
        monitor=EngineMonitor(platform.client, recorder),
        templates=make_templates(),
        nav=nav,
        static_versions=static_versions(),
        sso=OIDCClient(sso_settings) if sso_settings.enabled else None,
    )


def _session_store(platform: Platform, settings: WebUISettings) -> SessionBackend:
    """In the database when the platform shares its state with other replicas, else memory."""
    assert platform.tenancy is not None
    store = platform.tenancy.store
    idle, max_age = settings.session_idle_minutes * 60, settings.session_max_hours * 3600
    if store.settings.shares_state:
        return DatabaseSessionStore(store.db, idle_timeout_s=idle, max_age_s=max_age)
    return SessionStore(idle_timeout_s=idle, max_age_s=max_age)


def attach_webui(app: FastAPI) -> None:
    """The admin UI's error pages and static files on ``app`` (its routes are ``ROUTERS``,
    mounted with the application's others)."""
    app.add_exception_handler(LoginRequired, _login_required)
    app.add_exception_handler(Refused, _refused)
    api_http_errors = app.exception_handlers[StarletteHTTPException]

    async def http_error(request: Request, exc: Exception) -> Response:
        """An unknown address under /admin is a page saying so; /admin/api (and everything
        else) keeps the API's JSON errors."""
        assert isinstance(exc, StarletteHTTPException)
        path = route_path(request)
        if exc.status_code == 404 and _is_page_path(path) and request.method == "GET":
            return await _refused(
                request,
                Refused(
                    404,
                    "Page not found",
                    "There is no admin page at this address; the link may be mistyped or old.",
                    action=("Go to the overview", context.HOME),
                ),
            )
        response = api_http_errors(request, exc)
        return await response if inspect.isawaitable(response) else response

    app.add_exception_handler(StarletteHTTPException, http_error)
    access.mount_public_files(app, "/admin/static", _StaticFiles(directory=STATIC_DIR), "webui")


def _is_page_path(path: str) -> bool:
    return path.startswith("/admin/") and not path.startswith(("/admin/api/", "/admin/static/"))


class _StaticFiles(StaticFiles):
    """The UI's CSS and scripts, with the pages' ``nosniff`` (a file is only what its type
    says) and without framing."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("X-Frame-Options", "DENY")
        return response


# The admin UI's routers with their audiences (the app mounts them, see ``app.mount_routes``):
# the sign-in page is public; every page needs a session (one of SESSION_GUARDS).
SESSION_GUARDS = (
    context.page_admin,
    context.form_admin,
    context.form_session,  # signing out: any role
    context.json_admin,
    adapters.streamed_form_admin,  # the upload form, checked before its body is streamed
)
ROUTERS: tuple[tuple[APIRouter, Audience], ...] = (
    (login.router, "public"),
    (sso.router, "public"),  # single sign-on's start and callback: nobody is signed in yet
    *((page.router, "admin_ui") for page in PAGES),
)


async def _login_required(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    had_cookie = context.SESSION_COOKIE in request.cookies
    query = context.login_query(exc.next_path, expired=had_cookie)
    return redirect(request, f"{login.LOGIN_PATH}?{query}")


async def _refused(request: Request, exc: Exception) -> Response:
    """The error page, with the navigation when an operator is signed in (a 404 is not the
    end of the road) and without it otherwise."""
    assert isinstance(exc, Refused)
    try:
        session = await context.current_session(request)
    except Exception:  # the session store is down: the page still says what went wrong
        logger.exception("reading the session for an error page failed")
        session = None
    return render(
        request,
        "error.html",
        admin=Admin(session) if session is not None else None,
        status=exc.status,
        headers=exc.headers,
        title=exc.title,
        message=exc.message,
        action=exc.action,
    )
