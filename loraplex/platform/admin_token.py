"""The operator's admin token: the one credential of the operator, never a tenant key.

It comes from ``LORAPLEX_ADMIN_TOKEN`` (``settings.admin_token``) when that is set. Otherwise the
first start generates one (256 random bits, ``lpxadm_<43 characters>``), stores only its SHA-256
in ``PlatformSetting`` and hands the token back once, for ``serve`` to print; later starts find
the hash and print nothing secret. ``loraplex admin token rotate`` replaces the stored hash and
prints the new token; the old one fails from the next request on (the hash is read per check).
Tokens are compared by their SHA-256, in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Literal

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.platform import audit
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import PlatformSetting, utcnow
from loraplex.platform.settings import TenancySettings

SETTING_KEY = "admin_token_sha256"
TOKEN_PREFIX = "lpxadm_"
SYSTEM_ACTOR = "system"
ROTATE_HINT = "'loraplex admin token rotate' prints a new one"
MIN_LENGTH = 16

Source = Literal["env", "stored", "generated"]


class AdminTokenError(Exception):
    """The admin token cannot be changed here; the message says what to do instead."""


def configured_token(settings: TenancySettings) -> str | None:
    """``LORAPLEX_ADMIN_TOKEN``, checked; None when unset."""
    if settings.admin_token is None:
        return None
    token = settings.admin_token.get_secret_value()
    if len(token.strip()) < MIN_LENGTH or token != token.strip():
        raise ValueError(
            f"LORAPLEX_ADMIN_TOKEN must be at least {MIN_LENGTH} characters without surrounding "
            "spaces (for example the output of 'openssl rand -hex 32'); unset it to have one "
            "generated"
        )
    return token


def generate_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)  # 32 bytes = 256 bits


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def digest_matches(token: str, digest: str) -> bool:
    """Constant time in the token's content: compares SHA-256 digests of equal length."""
    return hmac.compare_digest(token_sha256(token), digest)


def stored_digest(session: Session) -> str | None:
    row = session.get(PlatformSetting, SETTING_KEY)
    return row.value if row is not None else None


def _store(session: Session, digest: str) -> None:
    row = session.get(PlatformSetting, SETTING_KEY)
    if row is None:
        session.add(PlatformSetting(key=SETTING_KEY, value=digest))
    else:
        row.value = digest
        row.updated_at = utcnow()
    session.flush()


@dataclass(frozen=True)
class AdminTokenStart:
    """What ``ensure`` found; ``token`` is set only when it was just generated (show it once)."""

    source: Source
    token: str | None = None

    def message(self) -> str:
        """One line for the server's start-up output."""
        if self.source == "env":
            return "loraplex: admin token: from LORAPLEX_ADMIN_TOKEN"
        if self.source == "generated":
            return (
                f"loraplex: admin token (shown only this once; store it now): {self.token}\n"
                f"loraplex: send it as 'Authorization: Bearer <token>' to /admin; {ROTATE_HINT}"
            )
        return (
            "loraplex: admin token: the one printed at this database's first start (only its "
            f"SHA-256 is stored); lost it? {ROTATE_HINT}"
        )


def ensure(db: Database, settings: TenancySettings) -> AdminTokenStart:
    """At server start (after migrations): the env token, the stored hash, or a new token."""
    if configured_token(settings) is not None:
        return AdminTokenStart("env")
    token = generate_token()

    def create(session: Session) -> bool:
        if stored_digest(session) is not None:
            return False
        _store(session, token_sha256(token))
        audit.record(session, SYSTEM_ACTOR, "admin_token.create", "platform_setting", SETTING_KEY)
        return True

    try:
        created = db.call(create)
    except IntegrityError:  # another replica generated one at the same moment: it printed it
        created = False
    return AdminTokenStart("generated", token) if created else AdminTokenStart("stored")


def rotate(session: Session, settings: TenancySettings, actor: str) -> str:
    """Replace the stored token with a new one and return it (the only copy)."""
    if settings.admin_token is not None:
        raise AdminTokenError(
            "the admin token comes from LORAPLEX_ADMIN_TOKEN; change that variable instead "
            "(and restart the server)"
        )
    token = generate_token()
    _store(session, token_sha256(token))
    audit.record(session, actor, "admin_token.rotate", "platform_setting", SETTING_KEY)
    return token


class AdminCredential:
    """Checks a presented token against the operator's: the configured one (kept as its digest)
    or the stored hash, read at every check so a rotation applies to the next request."""

    def __init__(self, settings: TenancySettings) -> None:
        configured = configured_token(settings)
        self._env_digest = token_sha256(configured) if configured is not None else None

    @property
    def from_env(self) -> bool:
        return self._env_digest is not None

    def matches_env(self, token: str) -> bool:
        return self._env_digest is not None and digest_matches(token, self._env_digest)

    def matches_stored(self, session: Session, token: str) -> bool:
        """Only when no env token is set (it replaces the stored one)."""
        if self._env_digest is not None or not token.startswith(TOKEN_PREFIX):
            return False
        digest = stored_digest(session)
        return digest is not None and digest_matches(token, digest)
