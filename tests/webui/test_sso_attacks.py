"""Single sign-on against a provider that answers with a redirect: the relying party never
follows it. Its calls are checked to be HTTPS (plain HTTP only to a loopback host) before they
are sent; a followed redirect would skip that check and carry the client secret (the token
request's ``Authorization: Basic``) to wherever the ``Location`` points, in clear over HTTP."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from loraplex.webui.oidc import OIDCClient, OIDCError, SSOSettings

pytestmark = pytest.mark.anyio


class Recorder(ThreadingHTTPServer):
    """Loopback HTTP server: ``answer(handler)`` answers each request; ``seen`` records them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                if length:
                    self.rfile.read(length)
                server.seen.append((self.command, self.path, dict(self.headers.items())))
                server.answer(self)

            do_GET = do_POST = _any

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.redirect_to = ""

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        if h.path == "/.well-known/openid-configuration":
            body = json.dumps(
                {
                    "issuer": self.url,
                    "authorization_endpoint": f"{self.url}/auth",
                    "token_endpoint": f"{self.url}/token",
                    "jwks_uri": f"{self.url}/jwks",
                    "token_endpoint_auth_methods_supported": ["client_secret_basic"],
                }
            ).encode()
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
        elif h.path == "/token" and self.redirect_to:
            body = b"{}"
            h.send_response(302)
            h.send_header("Location", self.redirect_to)
        else:
            body = b'{"error": "nothing here"}'
            h.send_response(404)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)


@pytest.fixture
def servers() -> Iterator[tuple[Recorder, Recorder]]:
    provider, elsewhere = Recorder(), Recorder()
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (provider, elsewhere)]
    for t in threads:
        t.start()
    try:
        yield provider, elsewhere
    finally:
        for s in (provider, elsewhere):
            s.shutdown()
            s.server_close()


async def test_a_redirect_from_the_token_endpoint_is_not_followed(
    servers: tuple[Recorder, Recorder],
) -> None:
    provider, elsewhere = servers
    provider.redirect_to = f"{elsewhere.url}/collect"
    client = OIDCClient(
        SSOSettings(
            issuer=provider.url,
            client_id="loraplex",
            client_secret="s3cret-client-secret",
            redirect_base_url="http://localhost:8000",
            operator_values="ops",
            http_timeout_s=5,
        )
    )
    with pytest.raises(OIDCError) as refused:
        await client.exchange("the-code", "the-verifier")
    assert "did not accept this sign-in's code" in str(refused.value)
    assert [(m, p) for m, p, _ in provider.seen][-1] == ("POST", "/token")
    assert "Authorization" in provider.seen[-1][2]  # the provider itself got the secret
    assert elsewhere.seen == [], "the redirect was followed, with the client's credentials"
