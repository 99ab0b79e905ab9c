"""Every number a caller sends is range-checked before any work is done with it: 10**20,
negatives, zero where it makes no sense, non-ASCII digits and dates outside what the server can
compute with are each a 4xx that says what was wrong and the allowed range, never a 500 (nor a
reset keep-alive connection), in the admin API, the tenant API and the admin UI."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils import registry as rf
from tests.utils.registry import bearer, registry_env, upload
from tests.utils.server import ServerThread
from tests.utils.web import csrf_of, sign_in

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models

BIG = 10**20
QUOTAS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "max_adapters")

# (method, path, JSON body, caller, status, a word the message must hold)
API: list[tuple[str, str, Any, str, int, str]] = [
    ("GET", f"/admin/api/tenants?offset={BIG}", None, "admin", 400, "from 0 to"),
    ("GET", "/admin/api/tenants?offset=-1", None, "admin", 400, "from 0 to"),
    ("GET", f"/admin/api/tenants?limit={BIG}", None, "admin", 400, "from 1 to 500"),
    ("GET", "/admin/api/tenants?limit=0", None, "admin", 400, "from 1 to 500"),
    ("GET", "/admin/api/tenants?limit=-5", None, "admin", 400, "from 1 to 500"),
    ("GET", "/admin/api/tenants?offset=%C2%B2", None, "admin", 400, "offset"),
    ("GET", f"/admin/api/audit?before_id={BIG}", None, "admin", 400, "from 1 to"),
    ("GET", "/admin/api/audit?before_id=0", None, "admin", 400, "from 1 to"),
    ("GET", "/admin/api/audit?before_id=-1", None, "admin", 400, "from 1 to"),
    ("GET", f"/admin/api/audit?limit={BIG}", None, "admin", 400, "from 1 to 500"),
    ("GET", "/admin/api/audit?limit=0", None, "admin", 400, "from 1 to 500"),
    ("GET", "/admin/api/audit?since=0001-01-01T00:00:00%2B01:00", None, "admin", 400, "1970"),
    ("GET", "/admin/api/audit?until=9999-12-31T23:59:59-12:00", None, "admin", 400, "9999-12-30"),
    ("GET", "/admin/api/usage?end=0001-01-05", None, "admin", 400, "1970-01-01"),
    ("GET", "/admin/api/usage?start=9999-12-31", None, "admin", 400, "9999-12-30"),
    ("GET", "/admin/api/tenants/acme/usage?start=0001-01-01", None, "admin", 400, "1970-01-01"),
    ("GET", "/v1/usage?end=0001-01-05", None, "tenant", 400, "1970-01-01"),
    ("GET", "/v1/usage?start=9999-12-31", None, "tenant", 400, "9999-12-30"),
    *[
        ("POST", "/admin/api/tenants", {"name": "big", "quotas": {q: v}}, "admin", 400, "10^12")
        for q in QUOTAS
        for v in (BIG, -1, 0)
    ],
    *[
        ("PATCH", "/admin/api/tenants/acme", {"quotas": {q: BIG}}, "admin", 400, "10^12")
        for q in QUOTAS
    ],
    ("POST", "/admin/api/tenants/acme/keys", {"expires_at": "9999-12-31T23:59:59-12:00"},
     "admin", 400, "before 9999-01-01"),
    # name@N: an N no version can have names no adapter (404), and is never queried with
    ("GET", f"/v1/adapters/bot@{BIG}", None, "tenant", 404, "No adapter"),
    ("GET", "/v1/adapters/bot@0", None, "tenant", 404, "No adapter"),
    ("GET", "/v1/adapters/bot@-1", None, "tenant", 404, "No adapter"),
    ("DELETE", f"/v1/adapters/bot@{BIG}", None, "tenant", 404, "No adapter"),
    ("GET", f"/admin/api/tenants/acme/adapters/bot@{BIG}", None, "admin", 404, "No adapter"),
    ("DELETE", f"/admin/api/tenants/acme/adapters/bot@{BIG}", None, "admin", 404, "No adapter"),
]  # fmt: skip

# Admin UI pages (signed in): (path, a word the page must hold)
UI_PAGES: list[tuple[str, str]] = [
    (f"/admin/tenants?page={BIG}", "9,999,999"),
    ("/admin/tenants?page=0", "9,999,999"),
    ("/admin/tenants?page=-1", "9,999,999"),
    ("/admin/tenants?page=%C2%B2", "9,999,999"),  # '²' passes str.isdigit, not int()
    (f"/admin/adapters?page={BIG}", "9,999,999"),
    (f"/admin/usage?page={BIG}", "9,999,999"),
    (f"/admin/audit?before={BIG}", "99,999,999,999"),
    ("/admin/audit?before=0", "99,999,999,999"),
    ("/admin/audit?before=%C2%B2", "99,999,999,999"),
    (f"/admin/keys?before={BIG}", "99,999,999,999"),
    ("/admin/keys?before=-3", "99,999,999,999"),
    ("/admin/keys?before=%C2%B2", "99,999,999,999"),
    ("/admin/usage?end=0001-01-05", "1970-01-01"),
    ("/admin/usage?start=9999-12-31", "9999-12-30"),
    ("/admin/audit?until=9999-12-31", "9999-12-30"),
    ("/admin/audit?since=0001-01-01", "1970-01-01"),
]

# Admin UI forms: (the form's page, its action, fields, a word the answer must hold)
UI_FORMS: list[tuple[str, str, dict[str, str], str]] = [
    *[
        ("/admin/tenants/-/new", "/admin/tenants", {"name": "big", q: v}, "1,000,000,000,000")
        for q in QUOTAS
        for v in (str(BIG), "-1", "0", "²")
    ],
    *[
        ("/admin/tenants/acme/edit", "/admin/tenants/acme/edit", {"display_name": "", q: str(BIG)},
         "1,000,000,000,000")
        for q in QUOTAS
    ],
    *[
        ("/admin/keys/new", "/admin/keys", {"tenant": "acme", "scopes": "inference",
                                            "expires_days": v}, "3,650")
        for v in (str(BIG), "0", "-1", "²")
    ],
    *[
        ("/admin/playground", "/admin/playground", {"prompt": "t30", "max_tokens": v},
         "Max tokens")
        for v in (str(BIG), "0", "-1", "²")
    ],
]  # fmt: skip


async def test_api_numbers_out_of_range_are_4xx_saying_the_range(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        callers = {"admin": env.admin_headers, "tenant": bearer(env.tenant("acme"))}
        wrong = []
        for method, path, body, who, status, word in API:
            r = await env.http.request(method, path, json=body, headers=callers[who])
            error = r.json().get("error") if r.headers["content-type"].startswith("app") else None
            if r.status_code != status or not error or word not in error["message"]:
                wrong.append((method, path, body, r.status_code, r.text[:300]))
        assert wrong == []


async def test_admin_ui_numbers_out_of_range_are_400_saying_the_range(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        env.tenant("acme")
        assert (await sign_in(env.http)).status_code == 303
        wrong = []
        for path, word in UI_PAGES:
            r = await env.http.get(path)
            if r.status_code != 400 or word not in r.text:
                wrong.append((path, r.status_code, r.text[:200]))
        for page, action, fields, word in UI_FORMS:
            form = await env.http.get(page)
            assert form.status_code == 200, (page, form.text[:300])
            r = await env.http.post(action, data={"csrf_token": csrf_of(form.text), **fields})
            if r.status_code != 400 or word not in r.text:
                wrong.append((action, fields, r.status_code, r.text[:200]))
        assert wrong == []


def _local_port(r: httpx.Response) -> int:
    stream = r.extensions["network_stream"]
    sock: socket.socket = stream.get_extra_info("socket")
    return int(sock.getsockname()[1])


async def test_a_400_digit_lora_alpha_is_a_400_on_a_kept_connection(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    """Over real HTTP: a 500 from an exception used to close the keep-alive connection too."""
    a = registry_models.adapters["a"]
    configs = {  # field: (the adapter, what the message says)
        "lora_alpha": (a.with_config(lora_alpha=10**400), "at most 1000000"),
        "alpha_pattern": (a.with_config(alpha_pattern={"v_proj": 10**400}), "at most 1000000"),
        "r": (a.with_config(r=10**400), "at most 65536"),
        "rank_pattern": (a.with_config(rank_pattern={"q_proj": 10**20}), "at most 65536"),
        "layers_to_transform": (a.with_config(layers_to_transform=[0, 10**20]), "0 to 999999"),
    }
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        token = env.tenant("acme")
        with ServerThread(env.app) as server, httpx.Client(base_url=server.url) as http:
            ports = set()
            for field, (bad, bound) in configs.items():
                files = [
                    ("file", (n, c, "application/octet-stream")) for n, c in bad.files().items()
                ]
                r = http.post("/v1/adapters", data={"name": "bot"}, files=files,
                              headers=bearer(token))  # fmt: skip
                assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_config"), r.text
                assert field in r.json()["error"]["message"] and bound in r.text
                ports.add(_local_port(r))
            r = http.get("/v1/adapters", headers=bearer(token))
            assert r.status_code == 200 and r.json()["data"] == []
            ports.add(_local_port(r))
            assert len(ports) == 1  # one connection served every request
        assert (await upload(env.http, token, "bot", a.files())).status_code == 201
