"""A real OpenID Connect provider for the single sign-on tests: Node's ``oidc-provider``
(``tests/oidc/provider.js``, installed by ``npm ci --prefix tests/oidc``), on a free local port.

``provider(redirect_uris)`` starts it (its accounts: ``alice`` with the operator group, ``bob``
with the viewer group, ``carol`` with neither; any password) and stops it afterwards;
``sso_settings(issuer, base)`` configures loraplex for it; ``sign_in_at_provider`` plays the
browser at the provider's sign-in form over HTTP and returns the callback URL it sends back to;
``start_sign_in`` and ``sso_sign_in`` do the whole round trip for an httpx client on the app.
Tests that need it skip where Node or the package is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import httpx
import pytest

from loraplex.webui.oidc import SSOSettings

OIDC_DIR = Path(__file__).parents[1] / "oidc"
NODE = shutil.which("node")
CLIENT_ID = "loraplex-admin"
CLIENT_SECRET = "test-client-secret-0123456789abcdef"
OPERATOR_GROUP, VIEWER_GROUP = "lpx-operators", "lpx-viewers"
BASE = "http://localhost"  # the app's address for httpx clients on it (a loopback host: http)

needs_provider = pytest.mark.skipif(
    NODE is None or not (OIDC_DIR / "node_modules" / "oidc-provider").is_dir(),
    reason="the SSO tests need Node and the provider: npm ci --prefix tests/oidc",
)


@dataclass(frozen=True)
class Provider:
    issuer: str
    process: subprocess.Popen[str]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def provider(redirect_uris: list[str]) -> Iterator[Provider]:
    assert NODE is not None
    config = {
        "port": free_port(),
        "client_id": CLIENT_ID,
        "client_secret": CLIENT_SECRET,
        "redirect_uris": redirect_uris,
    }
    process = subprocess.Popen(
        [NODE, str(OIDC_DIR / "provider.js"), json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # "ready <issuer>" once it listens
        if not line.startswith("ready "):
            raise RuntimeError(f"the OpenID provider did not start: {line!r}")
        yield Provider(line.split()[1], process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def sso_settings(issuer: str, base_url: str, **overrides: object) -> SSOSettings:
    values: dict[str, object] = {
        "issuer": issuer,
        "client_id": CLIENT_ID,
        "client_secret": CLIENT_SECRET,
        "redirect_base_url": base_url,
        "roles_claim": "groups",
        "operator_values": OPERATOR_GROUP,
        "viewer_values": VIEWER_GROUP,
        "display_name": "Test IdP",
    }
    values.update(overrides)
    return SSOSettings(**values)  # type: ignore[arg-type]


_FORM = re.compile(r'<form[^>]*action="([^"]+)"')


def sign_in_at_provider(authorize_url: str, login: str, redirect_base: str) -> str:
    """Follow the provider from ``authorize_url`` through its sign-in form as ``login``; the
    URL (under ``redirect_base``) it finally sends the browser to."""
    with httpx.Client(timeout=10) as idp:
        url = authorize_url
        for _ in range(10):
            if url.startswith(redirect_base):
                return url
            response = idp.get(url)
            if response.status_code in (302, 303):
                url = urljoin(url, response.headers["location"])
                continue
            action = _FORM.search(response.text)
            assert response.status_code == 200 and action, (response.status_code, response.text)
            posted = idp.post(
                urljoin(url, action.group(1)),
                data={"prompt": "login", "login": login, "password": "any"},
            )
            assert posted.status_code in (302, 303), posted.text
            url = urljoin(url, posted.headers["location"])
    raise AssertionError("the provider never sent the browser back")


async def start_sign_in(http: httpx.AsyncClient, next_path: str = "/admin/tenants") -> str:
    """Open the app's single sign-on; the provider's authorization URL (checked for PKCE
    S256, a state and a nonce)."""
    r = await http.get("/admin/sso/login?" + urlencode({"next": next_path}))
    assert r.status_code == 303, r.text
    query = parse_qs(urlsplit(r.headers["location"]).query)
    assert query["code_challenge_method"] == ["S256"] and len(query["code_challenge"][0]) == 43
    assert query["state"][0] and query["nonce"][0] and query["state"] != query["nonce"]
    return str(r.headers["location"])


async def sso_sign_in(
    http: httpx.AsyncClient, login: str, base: str = BASE, next_path: str = "/admin/tenants"
) -> httpx.Response:
    """Sign ``login`` in through the provider; the app's answer to the callback (303 when a
    session was opened)."""
    callback = sign_in_at_provider(await start_sign_in(http, next_path), login, base)
    return await http.get(callback)
