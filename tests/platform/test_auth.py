"""Authenticators decide the caller; tenancy plugs in as another one. Quotas answer 429."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import Request

from loraplex.platform.auth import SCOPE_INFERENCE, Caller, OperatorKeyAuthenticator
from loraplex.platform.errors import rate_limited
from loraplex.platform.settings import ServerSettings
from loraplex.server import create_app
from tests.utils.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio

CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "t30"}], "max_tokens": 1}


class TenantAuthenticator:
    """A stand-in for the tenancy authenticator: any key is tenant "acme" (inference only);
    the key "over-quota" is rate limited."""

    async def authenticate(self, request: Request) -> Caller:
        if request.headers.get("authorization") == "Bearer over-quota":
            raise rate_limited("You sent more than 60 requests this minute; slow down.", 12)
        return Caller(
            id="tenant:acme", scopes=frozenset({SCOPE_INFERENCE}), tenant_id="acme", cache_salt="s1"
        )


def _api(fake: FakeEngineClient, tokenizer: Any, **kwargs: Any) -> httpx.AsyncClient:
    app = create_app(fake, ServerSettings(), tokenizer=tokenizer, **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_tenant_caller_salts_the_prefix_cache(fake: FakeEngineClient, tokenizer: Any) -> None:
    async with _api(fake, tokenizer, authenticator=TenantAuthenticator()) as api:
        r = await api.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert fake.submitted[0].cache_extra_keys == ("salt:s1",)
        # a tenant key lacks adapters:write
        r = await api.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"


async def test_quota_is_429_with_retry_after(fake: FakeEngineClient, tokenizer: Any) -> None:
    async with _api(fake, tokenizer, authenticator=TenantAuthenticator()) as api:
        r = await api.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer over-quota"}
        )
    assert r.status_code == 429 and r.headers["retry-after"] == "12"
    assert r.json()["error"] == {
        "message": "You sent more than 60 requests this minute; slow down.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }


async def test_open_server_needs_no_key(fake: FakeEngineClient, tokenizer: Any) -> None:
    async with _api(fake, tokenizer) as api:
        assert (await api.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert fake.submitted[0].cache_extra_keys == ()
        assert (await api.get("/openapi.json")).status_code == 200


def test_empty_operator_key_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        OperatorKeyAuthenticator("")
