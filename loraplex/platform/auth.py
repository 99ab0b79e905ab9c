"""Who is calling: an ``Authenticator`` turns the request's credentials into a ``Caller``.

Today there is one: :class:`OperatorKeyAuthenticator`, a single operator API key sent as
``Authorization: Bearer <key>`` (or no key at all: an open server). Tenancy slots in as another
``Authenticator`` (``lpx_<id>_<secret>`` keys looked up in the database) returning callers with a
``tenant_id``, narrower ``scopes`` and a per-tenant ``cache_salt``; routes only ever see ``Caller``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Literal, Protocol

from fastapi import Request

from loraplex.platform.errors import INVALID_REQUEST, APIError

ANONYMOUS = "anonymous"  # the caller id of an open server's callers (no --api-key)
SCOPE_INFERENCE = "inference"
SCOPE_ADAPTERS_WRITE = "adapters:write"
SCOPE_ADMIN = "admin"
# The viewer role of the admin UI's single sign-on: the admin API's reads, never its writes.
SCOPE_ADMIN_READ = "admin:read"
ALL_SCOPES = frozenset({SCOPE_INFERENCE, SCOPE_ADAPTERS_WRITE, SCOPE_ADMIN})


CallerKind = Literal["operator", "tenant"]


@dataclass(frozen=True)
class Caller:
    """Who calls: the operator (its credential, or anyone on an open server) or a tenant (one
    of its keys, or the operator acting for it in the admin UI's playground)."""

    id: str  # stable, loggable: "operator", "anonymous", "tenant:<name>/key:<public id>"
    scopes: frozenset[str] = field(default_factory=frozenset)
    tenant_id: str | None = None  # set exactly for tenant callers
    key_id: str | None = None  # public part of the key used, for usage rows and audit
    cache_salt: str = ""  # joins the prefix-cache keys: tenants never share KV blocks
    max_priority: int | None = None  # the most urgent request priority allowed; None: any
    # The key's model allowlist (``model_access``); None: every model the caller can see.
    allowed_models: tuple[str, ...] | None = None

    @property
    def kind(self) -> CallerKind:
        return "operator" if self.tenant_id is None else "tenant"

    @property
    def cache_extra_keys(self) -> tuple[str, ...]:
        return (f"salt:{self.cache_salt}",) if self.cache_salt else ()

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes


class Authenticator(Protocol):
    async def authenticate(self, request: Request) -> Caller:
        """The caller of ``request``; raises ``APIError`` (401) for missing or bad credentials."""
        ...


def bearer_token(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None when the header is absent."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized(
            "The Authorization header is malformed; send 'Authorization: Bearer <your API key>'.",
            "invalid_authorization_header",
        )
    return token.strip()


class OperatorKeyAuthenticator:
    """One operator key, compared in constant time; ``api_key=None`` opens the server."""

    def __init__(self, api_key: str | None) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string, or None for an open server")
        self._key = api_key.encode() if api_key is not None else None

    async def authenticate(self, request: Request) -> Caller:
        if self._key is None:
            return Caller(id=ANONYMOUS, scopes=ALL_SCOPES)
        token = bearer_token(request)
        if token is None:
            raise _unauthorized(
                "No API key given; send it in the header 'Authorization: Bearer <your API key>' "
                "(the openai client's api_key= does this).",
                "missing_api_key",
            )
        if not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self._key):
            raise _unauthorized(
                f"Incorrect API key provided: {_redact(token)}; check the key you were given.",
                "invalid_api_key",
            )
        return Caller(id="operator", scopes=ALL_SCOPES)


def _redact(token: str) -> str:
    return f"{token[:3]}...{token[-4:]}" if len(token) > 10 else "***"


def _unauthorized(message: str, code: str) -> APIError:
    # OpenAI answers a bad key with type invalid_request_error and code invalid_api_key.
    return APIError(
        401, message, type=INVALID_REQUEST, code=code, headers={"WWW-Authenticate": "Bearer"}
    )
