"""Who is calling, on the multi-tenant platform: a tenant's key, or the operator's admin token.

``Authorization: Bearer lpx_<public id>_<secret>`` finds the key by its public id and checks the
secret's SHA-256 in constant time; the caller is the key's tenant, with the key's scopes. Nothing
is cached: a revoked or expired key, or a suspended tenant, is refused from the very next request.
The operator's admin token (see ``admin_token``) gives the admin caller, with every scope.

Every failed key gets the same 401 body, whatever was wrong (unknown id, wrong secret, not a key
at all), so that the answer never tells whether a public id exists. Only a caller holding the
right secret learns that the key was revoked or has expired.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from fastapi import Request
from sqlalchemy.orm import Session

from loraplex.platform.admin_token import TOKEN_PREFIX, AdminCredential
from loraplex.platform.auth import (
    ALL_SCOPES,
    SCOPE_ADAPTERS_WRITE,
    SCOPE_INFERENCE,
    Caller,
    bearer_token,
)
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import utcnow
from loraplex.platform.db.scope import find_key
from loraplex.platform.errors import INVALID_REQUEST, PERMISSION, APIError
from loraplex.platform.keys import hash_secret, parse_key, secret_matches

ADMIN_CALLER = Caller(id="admin", scopes=ALL_SCOPES)
# A tenant key never carries more than these, whatever its row says.
TENANT_KEY_SCOPES = frozenset({SCOPE_INFERENCE, SCOPE_ADAPTERS_WRITE})
# last_used_at is written at most this often per key (not once per request).
LAST_USED_EVERY = dt.timedelta(minutes=1)
# Compared against for an unknown public id, so that it costs what a wrong secret costs.
_NO_KEY_DIGEST = hash_secret("")


def _unauthorized(message: str, code: str = "invalid_api_key") -> APIError:
    # OpenAI answers a bad key with 401, type invalid_request_error, code invalid_api_key.
    return APIError(
        401, message, type=INVALID_REQUEST, code=code, headers={"WWW-Authenticate": "Bearer"}
    )


def invalid_key() -> APIError:
    """The one answer for every key that does not authenticate; it must not vary with the key."""
    return _unauthorized(
        "Incorrect API key provided. Keys look like lpx_<id>_<secret>; check that you copied "
        "the whole key, or ask the operator for a new one."
    )


def missing_key() -> APIError:
    return _unauthorized(
        "No API key given; send it in the header 'Authorization: Bearer <your API key>' "
        "(the openai client's api_key= does this).",
        "missing_api_key",
    )


class TenantAuthenticator:
    """The platform's ``Authenticator`` (see ``auth.Authenticator``)."""

    def __init__(
        self,
        db: Database,
        admin: AdminCredential,
        clock: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        self.db = db
        self.admin = admin
        self.clock = clock

    async def authenticate(self, request: Request) -> Caller:
        token = bearer_token(request)  # 401 for a malformed header
        if token is None:
            raise missing_key()
        if await self.is_admin(token):
            return ADMIN_CALLER
        parsed = parse_key(token)
        if parsed is None:
            raise invalid_key()
        public_id, secret = parsed
        return await self.db.run(lambda session: self._check_key(session, public_id, secret))

    async def is_admin(self, token: str) -> bool:
        """Whether ``token`` is the operator's admin token (also for the admin UI's login)."""
        if self.admin.from_env:
            return self.admin.matches_env(token)
        if not token.startswith(TOKEN_PREFIX):  # tenant keys never reach the database here
            return False
        return await self.db.run(lambda session: self.admin.matches_stored(session, token))

    def _check_key(self, session: Session, public_id: str, secret: str) -> Caller:
        found = find_key(session, public_id)
        if found is None:
            secret_matches(secret, _NO_KEY_DIGEST)  # same work as for a wrong secret
            raise invalid_key()
        key, tenant = found
        if not secret_matches(secret, key.secret_sha256):
            raise invalid_key()
        now = self.clock()
        if key.revoked_at is not None:
            raise _unauthorized(
                "This API key has been revoked; ask the operator for a new key.", "invalid_api_key"
            )
        if key.expires_at is not None and now >= key.expires_at:
            raise _unauthorized(
                f"This API key expired at {key.expires_at.isoformat(timespec='seconds')}; ask the "
                "operator for a new key.",
                "invalid_api_key",
            )
        if not tenant.active:
            raise APIError(
                403,
                f"Tenant {tenant.name!r} is suspended, so its API keys are refused; ask the "
                "operator to resume it.",
                type=PERMISSION,
                code="tenant_suspended",
            )
        if key.last_used_at is None or now - key.last_used_at >= LAST_USED_EVERY:
            key.last_used_at = now  # committed with this transaction
        return Caller(
            id=f"tenant:{tenant.name}/key:{key.public_id}",
            scopes=frozenset(key.scopes) & TENANT_KEY_SCOPES,
            tenant_id=str(tenant.id),
            key_id=key.public_id,
            cache_salt=tenant.cache_salt,
            max_priority=tenant.max_priority,
            allowed_models=None if key.allowed_models is None else tuple(key.allowed_models),
        )
