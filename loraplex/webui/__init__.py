"""The admin web UI: server-rendered pages under ``/admin`` (JSON admin API: ``/admin/api``).

``install_webui(app, platform)`` mounts the pages, the static files (``/admin/static``) and the
UI's state (``app.state.webui``). Pages are listed once, in ``PAGES``: each module there has a
``router`` and a ``NAV`` item (or None), and the navigation is built from that list, so a new
page is one module plus one line here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.staticfiles import StaticFiles

from loraplex.platform.tenancy import Platform
from loraplex.webui import (
    adapters,
    audit,
    context,
    keys,
    login,
    overview,
    playground,
    tenants,
    usage,
)
from loraplex.webui.context import (
    STATIC_DIR,
    LoginRequired,
    NavItem,
    Refused,
    WebUI,
    WebUISettings,
    make_templates,
    redirect,
    render,
    static_versions,
)
from loraplex.webui.live import EngineMonitor, LiveRecorder
from loraplex.webui.sessions import LoginThrottle, SessionStore

__all__ = ["PAGES", "WebUI", "WebUISettings", "install_webui", "load_webui_settings"]

PAGES: tuple[ModuleType, ...] = (
    overview,
    tenants,
    keys,
    adapters,
    usage,
    audit,
    playground,
)  # in navigation order


def load_webui_settings(**overrides: Any) -> WebUISettings:
    """Settings from the environment (``LORAPLEX_WEBUI_*``), then ``overrides``."""
    return WebUISettings(**overrides)


def install_webui(app: FastAPI, platform: Platform, settings: WebUISettings | None = None) -> WebUI:
    """Mount the admin UI on ``app``; returns its state (also ``app.state.webui``).

    ``webui.recorder.observe_record`` is a ``RequestLogMiddleware`` observer feeding the
    Overview's charts; when the app exposes its observer list as ``app.state.request_observers``
    (before it starts serving), it is added there.
    """
    settings = settings or load_webui_settings()
    recorder = LiveRecorder()
    nav: list[NavItem] = [page.NAV for page in PAGES if getattr(page, "NAV", None) is not None]
    webui = WebUI(
        platform=platform,
        settings=settings,
        sessions=SessionStore(
            idle_timeout_s=settings.session_idle_minutes * 60,
            max_age_s=settings.session_max_hours * 3600,
        ),
        throttle=LoginThrottle(
            max_failures=settings.login_max_failures, window_s=settings.login_window_seconds
        ),
        recorder=recorder,
        monitor=EngineMonitor(app.state.serving.client, recorder),
        templates=make_templates(),
        nav=nav,
        static_versions=static_versions(),
    )
    app.state.webui = webui
    observers = getattr(app.state, "request_observers", None)
    if isinstance(observers, list):
        observers.append(recorder.observe_record)

    app.add_exception_handler(LoginRequired, _login_required)
    app.add_exception_handler(Refused, _refused)
    app.mount("/admin/static", StaticFiles(directory=STATIC_DIR), name="webui-static")
    app.include_router(login.router)
    for page in PAGES:
        app.include_router(page.router)
    return webui


async def _login_required(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    had_cookie = context.SESSION_COOKIE in request.cookies
    query = context.login_query(exc.next_path, expired=had_cookie)
    return redirect(request, f"{login.LOGIN_PATH}?{query}")


async def _refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refused)
    return render(
        request,
        "error.html",
        status=exc.status,
        headers=exc.headers,
        title=exc.title,
        message=exc.message,
        action=exc.action,
    )
