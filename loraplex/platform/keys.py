"""Tenant API keys: ``lpx_<public id>_<secret>``.

The public id (12 characters) finds the key's row; the secret (32 characters of ``[A-Za-z0-9]``,
about 190 random bits) proves possession. Only ``SHA-256(secret)`` is stored, and it is compared
in constant time. A key is shown once, at creation; afterwards it is displayed as
``lpx_<public id>…<last 4>``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

PREFIX = "lpx_"
_ID_ALPHABET = string.ascii_lowercase + string.digits
_SECRET_ALPHABET = string.ascii_letters + string.digits
PUBLIC_ID_LEN = 12
SECRET_LEN = 32


@dataclass(frozen=True)
class NewKey:
    public_id: str
    secret: str

    @property
    def token(self) -> str:
        """The whole key, shown to its owner exactly once."""
        return f"{PREFIX}{self.public_id}_{self.secret}"

    @property
    def secret_sha256(self) -> str:
        return hash_secret(self.secret)

    @property
    def last4(self) -> str:
        return self.secret[-4:]


def generate_key() -> NewKey:
    public_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(PUBLIC_ID_LEN))
    secret = "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(SECRET_LEN))
    return NewKey(public_id, secret)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def parse_key(token: str) -> tuple[str, str] | None:
    """``(public_id, secret)`` of a well-formed key; None for anything else."""
    if not token.startswith(PREFIX):
        return None
    public_id, sep, secret = token[len(PREFIX) :].partition("_")
    if not sep or len(public_id) != PUBLIC_ID_LEN or len(secret) != SECRET_LEN:
        return None
    if not all(c in _ID_ALPHABET for c in public_id):
        return None
    if not all(c in _SECRET_ALPHABET for c in secret):
        return None
    return public_id, secret


def secret_matches(secret: str, stored_sha256: str) -> bool:
    """Constant-time comparison of ``SHA-256(secret)`` with the stored digest."""
    return hmac.compare_digest(hash_secret(secret), stored_sha256)


def display_key(public_id: str, last4: str) -> str:
    return f"{PREFIX}{public_id}…{last4}"
