"""The one place the web UI checks the operator's credential: the admin token of
``loraplex.platform.admin_token`` (``LORAPLEX_ADMIN_TOKEN``, or the generated token whose SHA-256
is stored in ``PlatformSetting``), compared by SHA-256 digest in constant time.

A session remembers the ``credential_version`` it signed in under and is re-checked against the
current one every few seconds, so changing the environment token or running
``loraplex admin token rotate`` signs every browser out too.

A single sign-on session (``sso``) has a version of its own, ``sso:<role>:<fingerprint>:<user>``
(at most 64 characters, the column's width): its role and user travel with it in both session
stores, and it stays valid while the SSO configuration's fingerprint is unchanged (a changed
provider, client or role mapping ends it), whatever happens to the admin token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from sqlalchemy.orm import Session

from loraplex.platform import admin_token
from loraplex.platform.keys import parse_key
from loraplex.platform.store import Store

MAX_TOKEN_CHARS = 512
SSO_PREFIX = "sso:"
MAX_VERSION_CHARS = 64
Role = Literal["operator", "viewer"]


@dataclass(frozen=True)
class SSOIdentity:
    role: Role
    fingerprint: str  # of the SSO configuration it signed in under
    user: str


def sso_version(role: Role, fingerprint: str, user: str) -> str:
    """The ``credential_version`` of a single sign-on session (``user`` may be shortened)."""
    head = f"{SSO_PREFIX}{role}:{fingerprint}:"
    return head + user.replace(":", "")[: MAX_VERSION_CHARS - len(head)]


def sso_identity(version: str) -> SSOIdentity | None:
    """The role, fingerprint and user of a single sign-on session's version; None otherwise."""
    if not version.startswith(SSO_PREFIX):
        return None
    role, _, rest = version[len(SSO_PREFIX) :].partition(":")
    fingerprint, _, user = rest.partition(":")
    if role not in ("operator", "viewer") or not fingerprint:
        return None
    return SSOIdentity(role, fingerprint, user)  # type: ignore[arg-type]


def looks_like_tenant_key(candidate: str) -> bool:
    return parse_key(candidate.strip()) is not None


def _current_digest(store: Store, session: Session) -> str | None:
    configured = admin_token.configured_token(store.settings)
    if configured is not None:
        return admin_token.token_sha256(configured)
    return admin_token.stored_digest(session)


def credential_version(store: Store, session: Session) -> str | None:
    """An opaque value that changes whenever the admin token does; None while there is none."""
    digest = _current_digest(store, session)
    if digest is None:
        return None
    return hashlib.sha256(f"webui-session:{digest}".encode()).hexdigest()[:32]


def verify_admin_token(store: Store, session: Session, candidate: str) -> str | None:
    """The ``credential_version`` when ``candidate`` is the admin token, else None.

    Runs in a worker thread (it may read the database). A tenant API key never matches.
    """
    candidate = candidate.strip()
    if not candidate or len(candidate) > MAX_TOKEN_CHARS or looks_like_tenant_key(candidate):
        return None
    digest = _current_digest(store, session)
    if digest is None or not admin_token.digest_matches(candidate, digest):
        return None
    return credential_version(store, session)
