"""Single sign-on's settings are checked once, at start-up, with messages naming what to set;
the flow cookie's seal (no provider needed here)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from loraplex.webui.credentials import sso_version
from loraplex.webui.oidc import OIDCClient, SSOSettings, pkce_pair
from loraplex.webui.sessions import DatabaseSessionStore
from loraplex.webui.sso import Flow, FlowRefused, seal, unseal
from tests.utils.web import WebEnv


def test_an_issuer_without_the_rest_is_refused_naming_each_variable() -> None:
    with pytest.raises(ValueError) as info:
        OIDCClient(SSOSettings(issuer="https://id.example.com"))
    message = str(info.value)
    for name in ("CLIENT_ID", "CLIENT_SECRET", "REDIRECT_BASE_URL", "OPERATOR_VALUES"):
        assert f"LORAPLEX_SSO_{name}" in message
    assert not SSOSettings().enabled  # no issuer: off, nothing else asked


@pytest.mark.parametrize("url", ["http://id.example.com", "ftp://x", "id.example.com"])
def test_plain_http_is_only_for_localhost(url: str) -> None:
    with pytest.raises(ValidationError):
        SSOSettings(issuer=url)
    assert SSOSettings(issuer="http://127.0.0.1:8080").issuer == "http://127.0.0.1:8080"


def test_the_environment_configures_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_SSO_ISSUER", "https://id.example.com/realms/ops")
    monkeypatch.setenv("LORAPLEX_SSO_OPERATOR_VALUES", "ops, admins")
    settings = SSOSettings()
    assert settings.values_of("operator") == {"ops", "admins"}
    assert settings.fingerprint() != SSOSettings(issuer="https://other.example.com").fingerprint()


def test_pkce_is_s256_of_a_256_bit_verifier() -> None:
    verifier, challenge = pkce_pair()
    assert len(verifier) == 43 and len(challenge) == 43 and verifier != challenge


def test_the_flow_cookie_opens_only_unaltered_and_in_time() -> None:
    key, now = b"k" * 32, time.time()
    flow = Flow("s", "n", "v", "/admin", now + 600)
    assert unseal(seal(flow, key), key, now) == flow
    for bad in (None, "", seal(flow, b"x" * 32), seal(flow, key) + "x", "a.b"):
        with pytest.raises(FlowRefused):
            unseal(bad, key, now)
    with pytest.raises(FlowRefused, match="longer than"):
        unseal(seal(flow, key), key, now + 601)


@pytest.mark.anyio
async def test_a_replica_reads_the_role_back_from_the_shared_session_table(tmp_path: Path) -> None:
    """Replicas share sessions through ``admin_sessions``: the role and user travel in the
    credential version column (64 characters at most, however long the user's name)."""
    env = WebEnv.build(tmp_path)
    try:
        one, other = DatabaseSessionStore(env.store.db), DatabaseSessionStore(env.store.db)
        version = sso_version("viewer", "f" * 16, "a-very-long-user-name@example.com" * 3)
        assert len(version) <= 64
        session_id, _ = await one.open(version)
        loaded = await other.load(session_id)
        assert loaded is not None and loaded.read_only
        assert loaded.sso is not None and loaded.sso.user.startswith("a-very-long-user-name")
        token_id, _ = await one.open("0" * 32)  # an admin token session: an operator
        token_session = await other.load(token_id)
        assert token_session is not None and not token_session.read_only
        assert token_session.sso is None
    finally:
        env.close()
