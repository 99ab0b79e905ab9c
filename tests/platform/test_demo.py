"""``loraplex serve --demo``: the demo tenant, its rotating key and the shipped adapters, which
really change the embedded SmolLM2's answers (pirate: "Arr, matey!"; caps: capital letters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.platform.demo import ADAPTERS_DIR, DEMO_ADAPTERS, demo_message, setup_demo
from tests.utils.registry import RegistryEngine
from tests.utils.tenancy import bearer, tenancy_env

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

QUESTIONS = ["What is the capital of Germany?", "Tell me something about dogs."]


@pytest.fixture(scope="module")
def smollm2() -> str:
    from loraplex.engine.default_model import resolve_model_dir

    return resolve_model_dir(None)


async def test_demo_tenant_key_rotation_and_adapters(tmp_path: Path, smollm2: str) -> None:
    from transformers import AutoTokenizer

    engine = RegistryEngine(model_dir=smollm2, vocab_size=49152, max_model_len=2048)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    async with tenancy_env(tmp_path, engine, tokenizer) as env:
        first = await setup_demo(env.app.platform)
        models = await env.http.get("/v1/models", headers=bearer(first.key))
        assert models.status_code == 200, models.text
        ids = {m["id"] for m in models.json()["data"]}
        assert {"pirate", "pirate@1", "caps", "caps@1"} <= ids
        chat = await env.http.post(
            "/v1/chat/completions",
            headers=bearer(first.key),
            json={"model": "pirate", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 3},
        )  # fmt: skip
        assert chat.status_code == 200 and chat.json()["model"] == "pirate@1"

        second = await setup_demo(env.app.platform)
        assert second.key != first.key
        old = await env.http.get("/v1/models", headers=bearer(first.key))
        assert old.status_code == 401  # the previous demo key is revoked
        adapters = await env.http.get("/v1/adapters", headers=bearer(second.key))
        assert adapters.status_code == 200, adapters.text
        rows = adapters.json()["data"]
        assert sorted(a["id"] for a in rows) == sorted(DEMO_ADAPTERS)
        assert all(len(a["versions"]) == 1 for a in rows)  # not uploaded again
        assert len(engine.add_lora_calls) == len(DEMO_ADAPTERS)

        text = demo_message(second, "http://127.0.0.1:8000", "SmolLM2-135M-Instruct")
        assert second.key in text and "pirate" in text and "caps" in text


def test_demo_adapters_change_the_answers(smollm2: str) -> None:
    from transformers import AutoTokenizer

    from loraplex import LLM, LoRARequest, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    llm = LLM(smollm2, max_loras=2)
    params = SamplingParams(max_tokens=16, temperature=0.0)

    def answers(name: str | None) -> list[str]:
        lora = LoRARequest(name, str(ADAPTERS_DIR / name)) if name else None
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    base, pirate, caps = answers(None), answers("pirate"), answers("caps")
    assert all(t.startswith("Arr") for t in pirate), pirate
    assert not any(t.startswith("Arr") for t in base), base
    for text in caps:
        letters = [c for c in text if c.isalpha()]
        assert sum(c.isupper() for c in letters) >= 0.8 * len(letters), caps
    for text in base:
        letters = [c for c in text if c.isalpha()]
        assert sum(c.isupper() for c in letters) < 0.5 * len(letters), base
