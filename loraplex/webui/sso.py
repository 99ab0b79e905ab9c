"""Single sign-on for the admin UI: ``GET /admin/sso/login`` sends the browser to the OpenID
provider, ``GET /admin/sso/callback`` takes it back and opens a session with the role the
provider's claim maps to (see ``oidc``). Both routes are public (nobody is signed in yet).

The flow's secrets (state, nonce, PKCE verifier, where to go afterwards, an expiry) live in one
cookie, ``lpx_sso_flow``, sealed with an HMAC whose key is derived from the client secret (every
replica holds it, so a callback may land on any replica), HttpOnly, SameSite=Lax (the provider
sends the browser back with a cross-site GET), scoped to ``/admin/sso``, ten minutes. It fails
closed: a callback without that cookie, with a cookie whose seal does not verify or whose time
is up, with a ``state`` other than the cookie's, or whose ID token's ``nonce`` is not the
cookie's, is refused with a page saying so and opens no session; the cookie is dropped after
every callback (one use).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import RedirectResponse, Response

from loraplex.webui.context import (
    SESSION_COOKIE,
    delete_cookie,
    redirect,
    render,
    safe_next,
    secure_headers,
    set_cookie,
    webui_of,
)
from loraplex.webui.credentials import sso_version
from loraplex.webui.oidc import CALLBACK_PATH, OIDCClient, OIDCError, pkce_pair, user_label

logger = logging.getLogger(__name__)

SSO_LOGIN_PATH = "/admin/sso/login"
FLOW_COOKIE = "lpx_sso_flow"
FLOW_PATH = "/admin/sso"
FLOW_TTL_S = 600
MAX_COOKIE_CHARS = 2000

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True)
class Flow:
    """One sign-in in progress (the sealed cookie's content)."""

    state: str
    nonce: str
    verifier: str
    next: str
    expires: float


def flow_key(sso: OIDCClient) -> bytes:
    secret = sso.settings.client_secret
    assert secret is not None  # SSOSettings.check
    return hmac.new(
        secret.get_secret_value().encode(), b"loraplex sso flow cookie v1", hashlib.sha256
    ).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def seal(flow: Flow, key: bytes) -> str:
    body = _b64(json.dumps(asdict(flow), separators=(",", ":")).encode())
    mac = _b64(hmac.new(key, body.encode("ascii"), hashlib.sha256).digest())
    return f"{body}.{mac}"


class FlowRefused(Exception):
    """Why the flow cookie is unusable (a sentence for the page)."""


def unseal(value: str | None, key: bytes, now: float) -> Flow:
    if not value:
        raise FlowRefused(
            "no sign-in was started in this browser (or its cookie was blocked or lost)"
        )
    body, _, mac = value.partition(".")
    expected = _b64(hmac.new(key, body.encode("ascii", "replace"), hashlib.sha256).digest())
    if len(value) > MAX_COOKIE_CHARS or not hmac.compare_digest(mac.encode(), expected.encode()):
        raise FlowRefused("its sign-in cookie was altered")
    try:
        data: dict[str, Any] = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        flow = Flow(**data)
    except (ValueError, TypeError):
        raise FlowRefused("its sign-in cookie was altered") from None
    if now > flow.expires:
        raise FlowRefused(f"it took longer than {FLOW_TTL_S // 60} minutes")
    return flow


def _client(request: Request) -> OIDCClient:
    sso = webui_of(request).sso
    if sso is None:
        raise OIDCError(
            "Single sign-on is not set up on this server; sign in with the admin token.",
            status=404,
        )
    return sso


def _refused(request: Request, exc: OIDCError, title: str = "Sign-in refused") -> Response:
    """An error page, no session, and the flow cookie dropped."""
    logger.warning("single sign-on refused: %s", exc.detail)
    response = render(
        request,
        "error.html",
        status=exc.status,
        title=title,
        message=str(exc),
        action=("Back to the sign-in page", "/admin/login"),
    )
    delete_cookie(request, response, FLOW_COOKIE, path=FLOW_PATH)
    return response


@router.get(SSO_LOGIN_PATH)
async def sso_login(request: Request) -> Response:
    """Start a sign-in: seal a new flow in the cookie, send the browser to the provider."""
    try:
        sso = _client(request)
        meta = await sso.metadata()
    except OIDCError as exc:
        return _refused(request, exc, "Single sign-on unavailable")
    verifier, challenge = pkce_pair()
    flow = Flow(
        state=secrets.token_urlsafe(32),
        nonce=secrets.token_urlsafe(32),
        verifier=verifier,
        next=safe_next(request.query_params.get("next")),
        expires=time.time() + FLOW_TTL_S,
    )
    url = sso.authorization_url(meta, state=flow.state, nonce=flow.nonce, challenge=challenge)
    response = secure_headers(RedirectResponse(url, status_code=303))
    set_cookie(
        request,
        response,
        FLOW_COOKIE,
        seal(flow, flow_key(sso)),
        path=FLOW_PATH,
        samesite="lax",
        max_age=FLOW_TTL_S,
    )
    return response


@router.get(CALLBACK_PATH)
async def sso_callback(request: Request) -> Response:
    """The provider sends the browser back here; every check passes or nobody is signed in."""
    webui = webui_of(request)
    query = request.query_params
    try:
        sso = _client(request)
        if query.get("error"):
            code = "".join(c for c in query["error"][:40] if c.isalnum() or c == "_")
            raise OIDCError(
                f"The identity provider did not sign you in ({code}). Start again, or ask "
                "whoever runs the identity provider for access to loraplex.",
                status=403 if code == "access_denied" else 400,
            )
        try:
            flow = unseal(request.cookies.get(FLOW_COOKIE), flow_key(sso), time.time())
        except FlowRefused as why:
            raise OIDCError(f"This sign-in cannot be completed: {why}. Start again.") from None
        state = query.get("state") or ""
        if not hmac.compare_digest(state.encode(), flow.state.encode()):
            raise OIDCError(
                "This sign-in cannot be completed: the answer's state does not belong to the "
                "sign-in started in this browser (it was altered, or another sign-in started "
                "since). Start again.",
                detail="state mismatch",
            )
        issuer = query.get("iss")
        if issuer is not None and issuer != sso.issuer:  # RFC 9207: a mixed-up provider
            raise OIDCError(
                "This sign-in cannot be completed: the answer came from another identity "
                "provider. Start again.",
                detail=f"iss parameter {issuer[:200]!r}",
            )
        grant = query.get("code")
        if not grant:
            raise OIDCError("The identity provider's answer has no code. Start again.")
        tokens = await sso.exchange(grant, flow.verifier)
        claims = await sso.verify_id_token(tokens.id_token, flow.nonce)
        role = sso.role_of(claims)
        if role is None and tokens.access_token is not None:
            claims = {**(await sso.userinfo(tokens.access_token, claims["sub"])), **claims}
            role = sso.role_of(claims)
        user = user_label(claims)
        if role is None:
            raise OIDCError(
                f"Your account ({user}) has no role in loraplex: the identity provider does not "
                f"give it any of the values that loraplex maps to the operator or viewer role "
                f"(claim {sso.settings.roles_claim!r}). Ask whoever runs loraplex to add you.",
                status=403,
                detail=f"no role for {user!r}",
            )
    except OIDCError as exc:
        return _refused(request, exc)
    await webui.sessions.end(request.cookies.get(SESSION_COOKIE))  # never promote a planted id
    session_id, session = await webui.sessions.open(
        sso_version(role, sso.settings.fingerprint(), user)
    )
    session.flash("success", f"Signed in as {user} ({role}).")
    logger.info("single sign-on: %s signed in as %s", user, role)
    response = redirect(request, flow.next)
    set_cookie(
        request,
        response,
        SESSION_COOKIE,
        session_id,
        samesite="lax",
        max_age=webui.settings.session_max_hours * 3600,
    )
    delete_cookie(request, response, FLOW_COOKIE, path=FLOW_PATH)
    return response
