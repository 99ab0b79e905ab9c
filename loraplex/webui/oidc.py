"""OpenID Connect for the admin UI's single sign-on: the relying party's half of the
authorization-code flow with PKCE (S256), against any standard provider.

    settings (LORAPLEX_SSO_*)  ->  OIDCClient
      metadata()                 /.well-known/openid-configuration of the issuer (cached an hour)
      authorization_url(...)     where the browser goes, with state, nonce and the S256 challenge
      exchange(code, verifier)   the token endpoint (client_secret_basic or _post)
      verify_id_token(t, nonce)  signature by the provider's JWKS, iss, aud (and azp), exp, iat,
                                 nonce; a key id not in the cached JWKS refetches it once
      userinfo(access_token)     for a role claim the ID token leaves out (its sub must match)
      role_of(claims)            operator / viewer / None from the configured claim and values

Invariants: the issuer in the discovery document and in every ID token is the configured one,
byte for byte; only asymmetric signature algorithms are accepted (never ``none`` or HS*); HTTP
to the provider is HTTPS, except to a loopback host (a provider on the same machine, as in the
tests). The provider's answers are read with a timeout and a size cap. Nothing here touches the
request or the session (``sso`` does); errors carry a sentence for people (``OIDCError``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

logger = logging.getLogger(__name__)

Role = Literal["operator", "viewer"]
ROLES: tuple[Role, ...] = ("operator", "viewer")
CALLBACK_PATH = "/admin/sso/callback"
# Asymmetric only: an HS* token would be signed with the client secret (which we hold too).
SIGNING_ALGS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512")
LEEWAY_S = 60  # clock skew tolerated on exp / iat
METADATA_TTL_S = 3600.0
MAX_RESPONSE_BYTES = 1 << 20
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class OIDCError(Exception):
    """The sign-in cannot go on; ``str(exc)`` is for the person signing in (no internals)."""

    def __init__(self, message: str, *, status: int = 400, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail or message  # for the log


def _words(value: str) -> tuple[str, ...]:
    return tuple(v for v in (part.strip() for part in value.replace(",", " ").split()) if v)


class SSOSettings(BaseSettings):
    """Single sign-on; ``LORAPLEX_SSO_<NAME>`` environment variables. Off while ``issuer`` is
    unset. The values lists are separated by commas or spaces."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_SSO_", extra="ignore", frozen=True)

    issuer: str | None = Field(
        default=None, description="the provider's issuer URL (discovery base)"
    )
    client_id: str = ""
    client_secret: SecretStr | None = None
    redirect_base_url: str = Field(
        default="", description="this server as browsers reach it, e.g. https://lpx.example.com"
    )
    scopes: str = "openid profile email groups"
    roles_claim: str = "groups"
    operator_values: str = ""
    viewer_values: str = ""
    display_name: str = "single sign-on"
    http_timeout_s: float = Field(default=10.0, gt=0, le=120)

    @field_validator("issuer", "redirect_base_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if not value:
            return value
        parsed = urllib.parse.urlsplit(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL")
        if parsed.scheme == "http" and parsed.hostname not in LOOPBACK_HOSTS:
            raise ValueError(f"{value!r} must use https (plain http only for localhost)")
        return value

    @property
    def enabled(self) -> bool:
        return bool(self.issuer)

    def check(self) -> None:
        """With an issuer, everything else the flow needs; raises ValueError naming what."""
        if not self.enabled:
            return
        missing = [
            f"LORAPLEX_SSO_{name.upper()}"
            for name, ok in (
                ("client_id", self.client_id),
                ("client_secret", self.client_secret and self.client_secret.get_secret_value()),
                ("redirect_base_url", self.redirect_base_url),
            )
            if not ok
        ]
        if not self.operator_values and not self.viewer_values:
            missing.append("LORAPLEX_SSO_OPERATOR_VALUES or LORAPLEX_SSO_VIEWER_VALUES")
        if missing:
            raise ValueError(
                "single sign-on (LORAPLEX_SSO_ISSUER is set) also needs " + ", ".join(missing)
            )
        if "openid" not in _words(self.scopes):
            raise ValueError("LORAPLEX_SSO_SCOPES must include 'openid'")

    @property
    def redirect_uri(self) -> str:
        return self.redirect_base_url.rstrip("/") + CALLBACK_PATH

    def values_of(self, role: Role) -> frozenset[str]:
        return frozenset(_words(self.operator_values if role == "operator" else self.viewer_values))

    def fingerprint(self) -> str:
        """Changes when the provider, client or role mapping does: sessions made under another
        configuration end (see ``credentials.sso_version``)."""
        text = "\n".join(
            (
                self.issuer or "",
                self.client_id,
                self.roles_claim,
                " ".join(sorted(self.values_of("operator"))),
                " ".join(sorted(self.values_of("viewer"))),
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ProviderMetadata:
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    userinfo_endpoint: str | None
    token_auth_methods: tuple[str, ...]
    signing_algs: tuple[str, ...]


@dataclass(frozen=True)
class Tokens:
    id_token: str
    access_token: str | None


def pkce_pair() -> tuple[str, str]:
    """(verifier, S256 challenge): RFC 7636, 43 characters of 256 random bits."""
    verifier = secrets.token_urlsafe(32)
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return verifier, base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


Fetch = Callable[[urllib.request.Request, float], tuple[int, bytes]]


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is the answer (an unusable one), never followed: ``_check_url`` vetted only the URL
    asked, and urllib would resend every header, the token request's client secret included,
    to whatever the ``Location`` names (plain HTTP too)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _urlopen(request: urllib.request.Request, timeout: float) -> tuple[int, bytes]:
    """(status, body) of ``request``; an HTTP error status (a 3xx too) is returned, not raised."""
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(MAX_RESPONSE_BYTES + 1)


class OIDCClient:
    def __init__(
        self,
        settings: SSOSettings,
        *,
        fetch: Fetch = _urlopen,
        clock: Callable[[], float] = time.time,
    ) -> None:
        settings.check()
        assert settings.issuer is not None
        self.settings = settings
        self.issuer: str = settings.issuer
        self._fetch = fetch
        self._clock = clock
        self._metadata: tuple[float, ProviderMetadata] | None = None
        self._jwks: KeySet | None = None

    # ---- HTTP --------------------------------------------------------------------------------

    async def _json(self, url: str, *, data: dict[str, str] | None = None,
                    headers: dict[str, str] | None = None, what: str) -> tuple[int, Any]:  # fmt: skip
        _check_url(url, what)
        body = urllib.parse.urlencode(data).encode() if data is not None else None
        request = urllib.request.Request(url, data=body, headers={"Accept": "application/json"})
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            status, raw = await asyncio.to_thread(
                self._fetch, request, self.settings.http_timeout_s
            )
        except (OSError, urllib.error.URLError) as exc:
            raise _unreachable(what, f"{url}: {exc}") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise _unreachable(what, f"{url}: answer over {MAX_RESPONSE_BYTES} bytes")
        try:
            return status, json.loads(raw)
        except ValueError:
            raise _unreachable(what, f"{url}: HTTP {status}, not JSON") from None

    async def metadata(self) -> ProviderMetadata:
        cached = self._metadata
        if cached is not None and self._clock() - cached[0] < METADATA_TTL_S:
            return cached[1]
        url = self.issuer.rstrip("/") + "/.well-known/openid-configuration"
        status, doc = await self._json(url, what="its discovery document")
        if status != 200 or not isinstance(doc, dict):
            raise _unreachable("its discovery document", f"{url}: HTTP {status}")
        if doc.get("issuer") != self.issuer:
            raise OIDCError(
                "Single sign-on is misconfigured: the identity provider names itself "
                f"{str(doc.get('issuer'))[:200]!r}, not LORAPLEX_SSO_ISSUER; set that variable to "
                "the provider's issuer exactly.",
                status=502,
            )
        try:
            meta = ProviderMetadata(
                issuer=doc["issuer"],
                authorization_endpoint=str(doc["authorization_endpoint"]),
                token_endpoint=str(doc["token_endpoint"]),
                jwks_uri=str(doc["jwks_uri"]),
                userinfo_endpoint=doc.get("userinfo_endpoint"),
                token_auth_methods=tuple(
                    doc.get("token_endpoint_auth_methods_supported") or ("client_secret_basic",)
                ),
                signing_algs=tuple(
                    a for a in doc.get("id_token_signing_alg_values_supported") or ("RS256",)
                    if a in SIGNING_ALGS
                ),
            )  # fmt: skip
        except KeyError as exc:
            raise _unreachable("its discovery document", f"{url}: no {exc}") from None
        methods = doc.get("code_challenge_methods_supported")
        if methods is not None and "S256" not in methods:
            raise OIDCError(
                "The identity provider does not support PKCE with S256, which loraplex requires.",
                status=502,
            )
        self._metadata = (self._clock(), meta)
        return meta

    # ---- the flow ----------------------------------------------------------------------------

    def authorization_url(
        self, meta: ProviderMetadata, *, state: str, nonce: str, challenge: str
    ) -> str:
        params = {
            "response_type": "code",
            "client_id": self.settings.client_id,
            "redirect_uri": self.settings.redirect_uri,
            "scope": " ".join(_words(self.settings.scopes)),
            "state": state,
            "nonce": nonce,
            "code_challenge": challenge,
            "code_challenge_method": "S256",
        }
        joiner = "&" if urllib.parse.urlsplit(meta.authorization_endpoint).query else "?"
        return meta.authorization_endpoint + joiner + urllib.parse.urlencode(params)

    async def exchange(self, code: str, verifier: str) -> Tokens:
        meta = await self.metadata()
        secret = (
            self.settings.client_secret.get_secret_value() if self.settings.client_secret else ""
        )
        data = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": self.settings.redirect_uri,
            "code_verifier": verifier,
        }
        headers: dict[str, str] = {}
        if "client_secret_basic" in meta.token_auth_methods:
            # RFC 6749 2.3.1: both parts form-urlencoded before base64.
            pair = f"{_form(self.settings.client_id)}:{_form(secret)}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
        else:
            data.update(client_id=self.settings.client_id, client_secret=secret)
        status, body = await self._json(
            meta.token_endpoint, data=data, headers=headers, what="its token endpoint"
        )
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("id_token"), str):
            error = body.get("error") if isinstance(body, dict) else None
            raise OIDCError(
                "The identity provider did not accept this sign-in's code (it may have been used "
                "already or expired). Start the sign-in again.",
                detail=f"token endpoint: HTTP {status}, error {error!r}",
            )
        access = body.get("access_token")
        return Tokens(body["id_token"], access if isinstance(access, str) else None)

    async def _keys(self, meta: ProviderMetadata, *, refresh: bool) -> KeySet:
        if self._jwks is None or refresh:
            status, doc = await self._json(meta.jwks_uri, what="its signing keys")
            if status != 200 or not isinstance(doc, dict):
                raise _unreachable("its signing keys", f"{meta.jwks_uri}: HTTP {status}")
            try:
                self._jwks = KeySet.import_key_set(doc)  # type: ignore[arg-type]
            except (JoseError, ValueError, TypeError, KeyError) as exc:
                raise _unreachable("its signing keys", f"{meta.jwks_uri}: {exc}") from None
        return self._jwks

    async def verify_id_token(self, id_token: str, nonce: str) -> dict[str, Any]:
        """The ID token's claims, after every check; OIDCError naming the failed one."""
        meta = await self.metadata()
        algs = list(meta.signing_algs or ("RS256",))
        try:
            header = json.loads(_b64(id_token.split(".")[0]))
            kid = header.get("kid") if isinstance(header, dict) else None
        except (ValueError, IndexError):
            raise _bad_token("it is not a JSON Web Token") from None
        keys = await self._keys(meta, refresh=False)
        if kid is not None and all(k.kid != kid for k in keys.keys):
            keys = await self._keys(meta, refresh=True)  # the provider rotated its keys
        try:
            token = jwt.decode(id_token, keys, algorithms=algs)
        except JoseError as exc:
            raise _bad_token("its signature does not verify", str(exc)) from None
        claims = dict(token.claims)
        client_id = self.settings.client_id
        audience = claims.get("aud")
        audiences = [audience] if isinstance(audience, str) else audience
        now = self._clock()
        if claims.get("iss") != self.issuer:
            raise _bad_token("it was issued by another provider", f"iss {claims.get('iss')!r}")
        if not isinstance(audiences, list) or client_id not in audiences:
            raise _bad_token("it was issued to another client", f"aud {audience!r}")
        if len(audiences) > 1 and claims.get("azp") != client_id:
            raise _bad_token("it was issued to another client", f"azp {claims.get('azp')!r}")
        exp, iat = claims.get("exp"), claims.get("iat")
        if not isinstance(exp, int | float) or now > exp + LEEWAY_S:
            raise _bad_token("it has expired", f"exp {exp!r}, now {now:.0f}")
        if not isinstance(iat, int | float) or iat > now + LEEWAY_S:
            raise _bad_token("it was issued in the future", f"iat {iat!r}, now {now:.0f}")
        sent = claims.get("nonce")
        if not isinstance(sent, str) or not secrets.compare_digest(sent, nonce):
            raise _bad_token("its nonce does not match this sign-in", "nonce mismatch")
        if not isinstance(claims.get("sub"), str) or not claims["sub"]:
            raise _bad_token("it names no user", "no sub")
        return claims

    async def userinfo(self, access_token: str, subject: str) -> dict[str, Any]:
        """The userinfo claims of ``subject``; {} when the provider has no userinfo endpoint."""
        meta = await self.metadata()
        if not meta.userinfo_endpoint:
            return {}
        status, body = await self._json(
            meta.userinfo_endpoint,
            headers={"Authorization": f"Bearer {access_token}"},
            what="its userinfo endpoint",
        )
        if status != 200 or not isinstance(body, dict) or body.get("sub") != subject:
            raise _bad_token("its user information belongs to another user", f"HTTP {status}")
        return body

    def role_of(self, claims: dict[str, Any]) -> Role | None:
        """The strongest role whose values meet the claim (a string or a list of strings)."""
        value = claims.get(self.settings.roles_claim)
        held = {value} if isinstance(value, str) else {v for v in value or () if isinstance(v, str)}
        for role in ROLES:
            if held & self.settings.values_of(role):
                return role
        return None


def user_label(claims: dict[str, Any]) -> str:
    """Who signed in, for the audit log and the page header: a short printable name."""
    for name in ("preferred_username", "email", "sub"):
        value = claims.get(name)
        if isinstance(value, str) and value.strip():
            text = "".join(c for c in value.strip() if c.isprintable() and c != ":")
            if text:
                return text[:40]
    return "unknown"


def _form(value: str) -> str:
    return urllib.parse.quote_plus(value)


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _check_url(url: str, what: str) -> None:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "https" or (parsed.scheme == "http" and parsed.hostname in LOOPBACK_HOSTS):
        return
    raise _unreachable(what, f"{url}: not https")


def _unreachable(what: str, detail: str) -> OIDCError:
    return OIDCError(
        f"The identity provider could not be reached or gave an unusable answer ({what}). "
        "Try again in a minute; if it persists, the operator should check the LORAPLEX_SSO_* "
        "settings and the server's log.",
        status=502,
        detail=detail,
    )


def _bad_token(why: str, detail: str = "") -> OIDCError:
    return OIDCError(
        f"The identity provider's answer was refused: {why}. Nobody was signed in; start the "
        "sign-in again.",
        detail=detail or why,
    )
