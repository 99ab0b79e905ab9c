"""Sign in with the admin token, sign out.

The sign-in form is protected against cross-site posting by a double-submit token: a random value
in an HttpOnly, SameSite=Strict cookie scoped to ``/admin/login`` and the same value in the form.
Failed attempts are counted per client address (``LoginThrottle``); over the limit the form
answers 429 with ``Retry-After`` until the window has passed, whatever the token. A successful
sign-in always starts a new session (a session id planted before sign-in is never promoted).
"""

from __future__ import annotations

import hmac
import secrets

from fastapi import APIRouter, Request
from starlette.responses import Response

from loraplex.webui.context import (
    CSRF_FIELD,
    LOGIN_COOKIE,
    SESSION_COOKIE,
    Refused,
    SessionPost,
    client_address,
    current_session,
    delete_cookie,
    redirect,
    render,
    safe_next,
    set_cookie,
    webui_of,
)
from loraplex.webui.credentials import looks_like_tenant_key, verify_admin_token

LOGIN_PATH = "/admin/login"

NOTICES = {  # ?notice=<code>: fixed texts only, nothing from the URL is echoed
    "signed_out": "You have signed out.",
    "expired": "Your session has ended; sign in again to continue.",
}

router = APIRouter(include_in_schema=False)


def _login_page(
    request: Request,
    token: str,
    next_path: str,
    *,
    error: str | None = None,
    status: int = 200,
    headers: dict[str, str] | None = None,
) -> Response:
    notice = NOTICES.get(request.query_params.get("notice", ""))
    sso = webui_of(request).sso
    response = render(
        request,
        "login.html",
        status=status,
        headers=headers,
        title="Sign in",
        login_token=token,
        next_path=next_path,
        error=error,
        notice=None if error else notice,
        sso_name=sso.settings.display_name if sso is not None else None,
    )
    set_cookie(request, response, LOGIN_COOKIE, token, path=LOGIN_PATH)
    return response


@router.get("/admin/")
async def overview_slash(request: Request) -> Response:
    """``/admin/`` is the Overview's address too (public: the Overview asks for the session)."""
    return redirect(request, "/admin", status=307)


@router.get(LOGIN_PATH)
async def login_form(request: Request) -> Response:
    next_path = safe_next(request.query_params.get("next"))
    if await current_session(request) is not None:
        return redirect(request, next_path)
    token = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(32)
    return _login_page(request, token[:64], next_path)


@router.post(LOGIN_PATH)
async def login(request: Request) -> Response:
    webui = webui_of(request)
    client = client_address(request)
    form = await request.form()
    next_value = form.get("next")
    next_path = safe_next(next_value if isinstance(next_value, str) else None)
    cookie_token = request.cookies.get(LOGIN_COOKIE, "")
    sent_token = form.get(CSRF_FIELD)
    if not (
        cookie_token
        and isinstance(sent_token, str)
        and hmac.compare_digest(sent_token.encode(), cookie_token.encode())
    ):
        raise Refused(
            403,
            "This sign-in form was refused",
            "The form did not carry a valid security token: it is stale, cookies are blocked, "
            "or it was sent from another site. Open the sign-in page again and retry.",
            action=("Open the sign-in page", LOGIN_PATH),
        )
    # The throttle slows down failures, never the right token: a neighbour behind the same
    # proxy (one address) cannot lock the operator out by failing on purpose. Guessing gains
    # nothing from this: the token has at least 16 characters (a generated one 256 bits), and
    # every wrong guess while throttled still costs the guesser a 429.
    token_value = form.get("token")
    candidate = token_value if isinstance(token_value, str) else ""
    store = webui.store
    version = await store.db.run(lambda s: verify_admin_token(store, s, candidate))
    if version is None:
        throttled = webui.throttle.retry_after(client)
        webui.throttle.failed(client)
        wait = throttled or webui.throttle.retry_after(client)
        if wait:
            return _throttled(request, cookie_token, next_path, wait)
        if not candidate.strip():
            error = "Enter the admin token."
        elif looks_like_tenant_key(candidate):
            error = (
                "That is a tenant API key; tenant keys never open the admin UI. "
                "Sign in with the admin token."
            )
        else:
            error = (
                "That is not the admin token. It is the value of LORAPLEX_ADMIN_TOKEN, or the "
                "token printed once when the server first started."
            )
        return _login_page(request, cookie_token, next_path, error=error, status=401)

    webui.throttle.succeeded(client)
    await webui.sessions.end(request.cookies.get(SESSION_COOKIE))  # never promote a planted id
    session_id, session = await webui.sessions.open(version)
    session.flash("success", "Signed in.")
    response = redirect(request, next_path)
    set_cookie(request, response, SESSION_COOKIE, session_id)
    delete_cookie(request, response, LOGIN_COOKIE, path=LOGIN_PATH)
    return response


def _throttled(request: Request, token: str, next_path: str, wait: int) -> Response:
    when = f"{wait} seconds" if wait < 90 else f"about {round(wait / 60)} minutes"
    return _login_page(
        request,
        token,
        next_path,
        error=(
            f"Too many failed sign-ins from your address. Wait {when}, then try again "
            "with the admin token."
        ),
        status=429,
        headers={"Retry-After": str(wait)},
    )


@router.post("/admin/logout")
async def logout(request: Request, admin: SessionPost) -> Response:
    await webui_of(request).sessions.end(request.cookies.get(SESSION_COOKIE))
    response = redirect(request, f"{LOGIN_PATH}?notice=signed_out")
    delete_cookie(request, response, SESSION_COOKIE)
    return response
