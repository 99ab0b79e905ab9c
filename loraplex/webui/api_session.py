"""An admin UI session as a caller of the admin API (``/admin/api``), for requests without an
``Authorization`` header (``access.operator_caller`` asks ``LoraplexApp.admin_session``).

A viewer's session is a read-only caller (``admin:read``): the API answers its reads and refuses
its writes (403 ``read_only_role``). An operator's session may write when the request carries the
session's CSRF token in ``X-CSRF-Token`` (a cookie alone never changes anything: another site
could make the browser send it). The admin token, as a bearer token, works as it always has.
"""

from __future__ import annotations

from fastapi import Request

from loraplex.platform.auth import SCOPE_ADMIN, SCOPE_ADMIN_READ, Caller
from loraplex.platform.errors import PERMISSION, APIError
from loraplex.webui.context import SESSION_COOKIE, current_session

CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def session_caller(request: Request) -> Caller | None:
    """The caller of the request's admin UI session; None without a live session."""
    if SESSION_COOKIE not in request.cookies:
        return None
    session = await current_session(request)
    if session is None:
        return None
    identity = session.sso
    caller_id = f"sso:{identity.user}" if identity is not None else "admin (web session)"
    if session.read_only:
        return Caller(id=caller_id, scopes=frozenset({SCOPE_ADMIN_READ}))
    if request.method not in SAFE_METHODS and not session.csrf_matches(
        request.headers.get(CSRF_HEADER)
    ):
        raise APIError(
            403,
            "A change through the admin API with an admin UI session's cookie needs the "
            "session's CSRF token in the X-CSRF-Token header; scripts should send the admin "
            "token as 'Authorization: Bearer <token>' instead.",
            type=PERMISSION,
            code="csrf_token_required",
        )
    return Caller(id=caller_id, scopes=frozenset({SCOPE_ADMIN, SCOPE_ADMIN_READ}))
