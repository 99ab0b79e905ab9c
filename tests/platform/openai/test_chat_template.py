"""How a chat request ends its prompt, with vLLM's meaning of the fields: the assistant's turn
opener by default (``add_generation_prompt``), none with ``add_generation_prompt: false``, and the
last (assistant) message left open with ``continue_final_message``; the exact prompt is checked
against the real SmolLM2 template and the tiny test template."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.utils.app import make_app
from tests.utils.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio

SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n"
)
USER = {"role": "user", "content": "Write a haiku"}
PARTIAL = {"role": "assistant", "content": "Cherry blossoms"}
# "<|im_start|>user\nWrite a haiku<|im_end|>\n" in SmolLM2's vocabulary
USER_TURN_IDS = [1, 4093, 198, 19161, 253, 421, 30614, 2, 198]
# "<|im_start|>assistant\n" and "Cherry blossoms"
OPENER_IDS = [1, 520, 9531, 198]
PARTIAL_IDS = [51, 349, 541, 31455]


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from loraplex.engine.default_model import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture
def smollm2_fake(smollm2_tokenizer: Any) -> FakeEngineClient:
    return FakeEngineClient(
        model_dir=smollm2_tokenizer.name_or_path, max_model_len=2048, vocab_size=49152
    )


@pytest.fixture
async def smollm2_api(
    smollm2_fake: FakeEngineClient, smollm2_tokenizer: Any
) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(smollm2_fake, smollm2_tokenizer, served_model_name="smol")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def _prompt(
    api: httpx.AsyncClient, fake: FakeEngineClient, model: str, **fields: Any
) -> list[int]:
    r = await api.post("/v1/chat/completions", json={"model": model, "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    return fake.submitted[-1].prompt_token_ids


def _tail(ids: list[int], tokenizer: Any) -> list[int]:
    """The ids after SmolLM2's default system turn (which they must start with)."""
    system = tokenizer(SYSTEM, add_special_tokens=False).input_ids
    assert ids[: len(system)] == system, tokenizer.decode(ids)
    return ids[len(system) :]


async def test_smollm2_generation_prompt_by_default_and_when_null(
    smollm2_api: httpx.AsyncClient, smollm2_fake: FakeEngineClient, smollm2_tokenizer: Any
) -> None:
    for fields in ({}, {"add_generation_prompt": True}, {"add_generation_prompt": None}):
        ids = await _prompt(smollm2_api, smollm2_fake, "smol", messages=[USER], **fields)
        assert _tail(ids, smollm2_tokenizer) == USER_TURN_IDS + OPENER_IDS, fields
        assert smollm2_tokenizer.decode(ids) == (
            SYSTEM + "<|im_start|>user\nWrite a haiku<|im_end|>\n<|im_start|>assistant\n"
        )


async def test_smollm2_without_generation_prompt_ends_with_the_last_turn(
    smollm2_api: httpx.AsyncClient, smollm2_fake: FakeEngineClient, smollm2_tokenizer: Any
) -> None:
    ids = await _prompt(
        smollm2_api, smollm2_fake, "smol", messages=[USER], add_generation_prompt=False
    )
    assert _tail(ids, smollm2_tokenizer) == USER_TURN_IDS
    assert smollm2_tokenizer.decode(ids) == SYSTEM + "<|im_start|>user\nWrite a haiku<|im_end|>\n"


async def test_smollm2_continue_final_message_leaves_the_answer_open(
    smollm2_api: httpx.AsyncClient, smollm2_fake: FakeEngineClient, smollm2_tokenizer: Any
) -> None:
    for fields in ({}, {"add_generation_prompt": False}):
        ids = await _prompt(
            smollm2_api,
            smollm2_fake,
            "smol",
            messages=[USER, PARTIAL],
            continue_final_message=True,
            **fields,
        )
        assert _tail(ids, smollm2_tokenizer) == USER_TURN_IDS + OPENER_IDS + PARTIAL_IDS, fields
        assert smollm2_tokenizer.decode(ids) == (
            SYSTEM
            + "<|im_start|>user\nWrite a haiku<|im_end|>\n<|im_start|>assistant\nCherry blossoms"
        )
    # without it, the same messages close the assistant's turn and open a new one
    ids = await _prompt(smollm2_api, smollm2_fake, "smol", messages=[USER, PARTIAL])
    assert smollm2_tokenizer.decode(ids).endswith(
        "Cherry blossoms<|im_end|>\n<|im_start|>assistant\n"
    )


# The tiny template: each message is "t3 <content> t4 ", the generation prompt "t5".
async def test_tiny_template_turn_ends(api: httpx.AsyncClient, fake: FakeEngineClient) -> None:
    user = {"role": "user", "content": "t30"}
    partial = {"role": "assistant", "content": "t31 t32"}
    assert await _prompt(api, fake, "tiny-chat", messages=[user]) == [3, 30, 4, 5]
    assert await _prompt(api, fake, "tiny-chat", messages=[user], add_generation_prompt=None) == [
        3,
        30,
        4,
        5,
    ]
    assert await _prompt(api, fake, "tiny-chat", messages=[user], add_generation_prompt=False) == [
        3,
        30,
        4,
    ]
    assert await _prompt(
        api, fake, "tiny-chat", messages=[user, partial], continue_final_message=True
    ) == [3, 30, 4, 3, 31, 32]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"messages": [USER, PARTIAL], "continue_final_message": True,
             "add_generation_prompt": True},
            "continue_final_message",
            "set only one of them",
        ),
        (
            {"messages": [USER], "continue_final_message": True},
            "continue_final_message",
            "must be the assistant's",
        ),
    ],
)  # fmt: skip
async def test_continue_final_message_misuse_is_400(
    smollm2_api: httpx.AsyncClient,
    smollm2_fake: FakeEngineClient,
    fields: dict[str, Any],
    param: str,
    words: str,
) -> None:
    r = await smollm2_api.post(
        "/v1/chat/completions", json={"model": "smol", "max_tokens": 1, **fields}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value"), error
    assert words in error["message"], error["message"]
    assert smollm2_fake.submitted == []


@pytest.fixture
def bos_tokenizer(tokenizer: Any) -> Any:
    """The tiny tokenizer, adding BOS (t1) in front of every text unless told not to."""
    from tokenizers import Tokenizer, processors

    bos = tokenizer.__class__(
        tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
        chat_template=tokenizer.chat_template,
    )
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="t1 $A", special_tokens=[("t1", 1)]
    )
    return bos


async def test_add_special_tokens(fake: FakeEngineClient, bos_tokenizer: Any) -> None:
    """vLLM's defaults: completions add BOS, chat does not (the template writes its own)."""
    app = make_app(fake, bos_tokenizer)
    transport = httpx.ASGITransport(app=app)
    user = [{"role": "user", "content": "t30"}]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as api:

        async def completion(**fields: Any) -> list[int]:
            body = {"model": "tiny-chat", "prompt": "t30", "max_tokens": 1, **fields}
            r = await api.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return fake.submitted[-1].prompt_token_ids

        assert await completion() == [1, 30]
        assert await completion(add_special_tokens=True) == [1, 30]
        assert await completion(add_special_tokens=False) == [30]
        assert await _prompt(api, fake, "tiny-chat", messages=user) == [3, 30, 4, 5]
        assert await _prompt(api, fake, "tiny-chat", messages=user, add_special_tokens=True) == [
            1, 3, 30, 4, 5,
        ]  # fmt: skip
