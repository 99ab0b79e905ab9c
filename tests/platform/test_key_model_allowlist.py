"""A key limited to a list of models (issue 34.3): other models answer exactly like a model that
does not exist, through the official ``openai`` client, on the demo tenant's real adapters
(pirate, caps) served by the embedded SmolLM2's registry engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from loraplex.platform.demo import DEMO_TENANT, setup_demo
from loraplex.platform.errors import APIError, model_not_found
from loraplex.platform.model_access import allows, check_allowed_models
from tests.utils.registry import RegistryEngine
from tests.utils.tenancy import TenancyEnv, bearer, tenancy_env

pytestmark = pytest.mark.anyio

CHAT: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def smollm2() -> str:
    from loraplex.engine.default_model import resolve_model_dir

    return resolve_model_dir(None)


@asynccontextmanager
async def demo_env(
    tmp_path: Path, smollm2: str, **settings: Any
) -> AsyncIterator[tuple[TenancyEnv, str]]:
    from transformers import AutoTokenizer

    engine = RegistryEngine(model_dir=smollm2, vocab_size=49152, max_model_len=2048)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    async with tenancy_env(tmp_path, engine, tokenizer, **settings) as env:
        await setup_demo(env.app.platform)
        yield env, env.app.platform.serving.resolver.base_name


@pytest.fixture
async def demo(tmp_path: Path, smollm2: str) -> AsyncIterator[tuple[TenancyEnv, str]]:
    """The demo tenant with its adapters, and the base model's served name."""
    async with demo_env(tmp_path, smollm2) as found:
        yield found


def client(env: TenancyEnv, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key=key, base_url="http://test/v1", http_client=env.http, max_retries=0
    )


async def new_key(env: TenancyEnv, tenant: str, **body: Any) -> dict[str, Any]:
    r = await env.http.post(
        f"/admin/api/tenants/{tenant}/keys", headers=env.admin_headers, json=body
    )
    assert r.status_code == 201, r.text
    return dict(r.json())


async def refusal(env: TenancyEnv, key: str, model: str) -> tuple[int, dict[str, Any]]:
    """The raw answer (status, body) to a chat request on ``model``."""
    r = await env.http.post(
        "/v1/chat/completions", headers=bearer(key),
        json={"model": model, "messages": CHAT, "max_tokens": 2},
    )  # fmt: skip
    return r.status_code, r.json()


async def test_a_key_limited_to_pirate_gets_404_like_a_missing_model(
    demo: tuple[TenancyEnv, str],
) -> None:
    env, base = demo
    limited = await new_key(env, DEMO_TENANT, name="pirate only", allowed_models=["pirate"])
    assert limited["allowed_models"] == ["pirate"]
    pirate_only = client(env, limited["key"])

    for model in ("pirate", "pirate@1"):  # the name allows every version
        chat = await pirate_only.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
        assert chat.model == "pirate@1" and chat.choices[0].message.content is not None
    listed = await pirate_only.models.list()
    assert sorted(m.id for m in listed.data) == ["pirate", "pirate@1"]

    # A tenant with no adapters: for it, "caps" really does not exist.
    bare = env.tenant("bare")
    for model in ("caps", "caps@1", base):
        with pytest.raises(openai.NotFoundError) as refused:
            await pirate_only.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
        assert refused.value.code == "model_not_found" and refused.value.param == "model"
        status, body = await refusal(env, limited["key"], model)
        assert (status, body) == (404, model_not_found(model).body())
        if model != base:
            assert (status, body) == await refusal(env, bare, model)  # byte for byte
        with pytest.raises(openai.NotFoundError):
            await pirate_only.models.retrieve(model)
        with pytest.raises(openai.NotFoundError):
            await pirate_only.completions.create(model=model, prompt="hi", max_tokens=2)
        tokenize = await env.http.post("/tokenize", headers=bearer(limited["key"]),
                                       json={"model": model, "prompt": "hi"})  # fmt: skip
        assert tokenize.status_code == 404 and tokenize.json() == body
    # An unknown model: the same answer as before the list was consulted.
    status, body = await refusal(env, limited["key"], "nope")
    assert (status, body) == await refusal(env, bare, "nope")

    # The demo tenant's unlimited key still uses everything.
    full = client(env, (await new_key(env, DEMO_TENANT))["key"])
    for model in ("caps", base):
        chat = await full.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
        assert chat.choices[0].finish_reason is not None


async def test_the_allowlist_changes_from_the_next_request_and_is_audited(
    demo: tuple[TenancyEnv, str],
) -> None:
    env, base = demo
    key = await new_key(env, DEMO_TENANT, allowed_models=[base, "caps@1"])
    url = f"/admin/api/tenants/{DEMO_TENANT}/keys/{key['id']}"
    assert (await refusal(env, key["key"], base))[0] == 200
    assert (await refusal(env, key["key"], "caps@1"))[0] == 200
    assert (await refusal(env, key["key"], "caps"))[0] == 404  # one version allows only it

    r = await env.http.patch(url, headers=env.admin_headers, json={"allowed_models": ["caps"]})
    assert r.status_code == 200 and r.json()["allowed_models"] == ["caps"], r.text
    assert r.json()["name"] == key["name"]  # only the fields given change
    assert (await refusal(env, key["key"], base))[0] == 404
    assert (await refusal(env, key["key"], "caps"))[0] == 200

    r = await env.http.patch(url, headers=env.admin_headers, json={"allowed_models": None})
    assert r.status_code == 200 and r.json()["allowed_models"] is None
    assert (await refusal(env, key["key"], "pirate"))[0] == 200

    events = (
        await env.http.get("/admin/api/audit?action=key.update", headers=env.admin_headers)
    ).json()["data"]
    assert [e["after"]["allowed_models"] for e in reversed(events)] == [["caps"], None]
    assert events[-1]["before"]["allowed_models"] == [base, "caps@1"]

    for bad, says in (([], "at least one model"), (["a b"], "without spaces"),
                      ([f"m{i}" for i in range(65)], "at most 64")):  # fmt: skip
        r = await env.http.patch(url, headers=env.admin_headers, json={"allowed_models": bad})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "allowed_models"
    missing = await env.http.patch(
        f"/admin/api/tenants/{DEMO_TENANT}/keys/nokey", headers=env.admin_headers, json={}
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "key_not_found"


def test_allows_matches_names_not_what_exists() -> None:
    assert allows(None, "anything")
    assert allows(["pirate"], "pirate") and allows(["pirate"], "pirate@7")
    assert not allows(["pirate"], "pirate2") and not allows(["pirate"], "caps")
    assert allows(["pirate@2"], "pirate@2")
    assert not allows(["pirate@2"], "pirate") and not allows(["pirate@2"], "pirate@3")
    assert check_allowed_models([" pirate ", "pirate", "caps@1"]) == ["pirate", "caps@1"]
    assert check_allowed_models(None) is None
    with pytest.raises(APIError):
        check_allowed_models(["x" * 141])


async def test_a_limited_key_sees_and_manages_only_its_adapters(
    demo: tuple[TenancyEnv, str],
) -> None:
    """The registry's tenant routes follow the list too: no listing or 404 tells a pirate-only
    key that caps exists, and it cannot delete it."""
    env, _ = demo
    key = (await new_key(env, DEMO_TENANT, allowed_models=["pirate"]))["key"]
    bare = env.tenant("bare")
    listed = await env.http.get("/v1/adapters", headers=bearer(key))
    assert [a["id"] for a in listed.json()["data"]] == ["pirate"]
    for method in ("GET", "DELETE"):
        refused = await env.http.request(method, "/v1/adapters/caps", headers=bearer(key))
        missing = await env.http.request(method, "/v1/adapters/caps", headers=bearer(bare))
        assert refused.status_code == missing.status_code == 404
        assert refused.json() == missing.json()
    assert (await env.http.get("/v1/adapters/pirate@1", headers=bearer(key))).status_code == 200
    one_version = (await new_key(env, DEMO_TENANT, allowed_models=["caps@1"]))["key"]
    listed = await env.http.get("/v1/adapters", headers=bearer(one_version))
    assert [(a["id"], [v["id"] for v in a["versions"]]) for a in listed.json()["data"]] == [
        ("caps", ["caps@1"])
    ]
    upload = await env.http.post(
        "/v1/adapters", headers=bearer(key), data={"name": "other"},
        files={"files": ("adapter_config.json", b"{}", "application/json")},
    )  # fmt: skip
    assert upload.status_code == 403 and upload.json()["error"]["code"] == "model_not_allowed"
    full = (await new_key(env, DEMO_TENANT))["key"]
    still = await env.http.get("/v1/adapters", headers=bearer(full))
    assert sorted(a["id"] for a in still.json()["data"]) == ["caps", "pirate"]


async def test_a_limited_key_reads_only_its_models_usage(demo: tuple[TenancyEnv, str]) -> None:
    env, base = demo
    full = (await new_key(env, DEMO_TENANT))["key"]
    limited = (await new_key(env, DEMO_TENANT, allowed_models=["pirate"]))["key"]
    for model in ("pirate", "caps", base):
        assert (await refusal(env, full, model))[0] == 200
    everything = (await env.http.get("/v1/usage", headers=bearer(full))).json()
    assert {b["model"] for b in everything["data"]} == {"pirate@1", "caps@1", base}
    mine = (await env.http.get("/v1/usage", headers=bearer(limited))).json()
    assert [b["model"] for b in mine["data"]] == ["pirate@1"]
    (pirate,) = [b for b in everything["data"] if b["model"] == "pirate@1"]
    assert mine["totals"] == {k: pirate[k] for k in mine["totals"]}
    assert everything["totals"]["requests"] == 3


async def test_in_gateway_mode_the_list_names_models_as_requests_do(
    tmp_path: Path, smollm2: str
) -> None:
    """Gateway mode: adapters are 'tenant/name[@N]' in ``model``; the list uses those names,
    and the adapter routes (which take the bare name in their paths) follow it."""
    async with demo_env(tmp_path, smollm2, gateway_mode=True) as (env, _):
        key = (await new_key(env, DEMO_TENANT, allowed_models=["demo/pirate"]))["key"]
        bare = env.tenant("bare")
        assert (await refusal(env, key, "demo/pirate@1"))[0] == 200
        assert await refusal(env, key, "demo/caps") == await refusal(env, bare, "demo/caps")
        models = (await env.http.get("/v1/models", headers=bearer(key))).json()["data"]
        assert [m["id"] for m in models] == ["demo/pirate", "demo/pirate@1"]
        listed = await env.http.get("/v1/adapters", headers=bearer(key))
        assert [a["id"] for a in listed.json()["data"]] == ["pirate"]
        assert (await env.http.get("/v1/adapters/pirate", headers=bearer(key))).status_code == 200
        refused = await env.http.get("/v1/adapters/caps", headers=bearer(key))
        assert (
            refused.json() == (await env.http.get("/v1/adapters/caps", headers=bearer(bare))).json()
        )
        upload = await env.http.post(
            "/v1/adapters", headers=bearer(key), data={"name": "other"},
            files={"files": ("adapter_config.json", b"{}", "application/json")},
        )  # fmt: skip
        assert upload.status_code == 403, upload.text
        upload = await env.http.post(
            "/v1/adapters", headers=bearer(key), data={"name": "pirate"},
            files={"files": ("adapter_config.json", b"{}", "application/json")},
        )  # fmt: skip
        assert upload.status_code == 400, upload.text  # past the list: the files are refused
