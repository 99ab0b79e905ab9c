"""An API on a fake engine that writes scripted text (tool calls, JSON), with SmolLM2's real
tokenizer and chat template (the embedded model's) or a Qwen-style template that renders tools
itself: what the structured-output and tool-call API tests drive."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.engine.client import RequestDelta
from tests.utils.fakes import FakeEngineClient, Submitted

# Qwen2.5's tool-calling template, cut to what the tests read: tools in the system turn, the
# assistant's calls in <tool_call> blocks, tool results as <tool_response> in a user turn.
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are Qwen.{% endif %}

# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tool_call in message.tool_calls %}<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ message.content }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def smollm2_dir() -> str:
    """The embedded model's directory (tokenizer and chat template)."""
    from loraplex.engine.default_model import resolve_model_dir

    return str(resolve_model_dir(None))


def tokenizer_copy(path: Path, chat_template: str | None = None) -> str:
    """SmolLM2's tokenizer files in ``path``, with ``chat_template`` when given."""
    import shutil

    source = Path(smollm2_dir())
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    if (source / "chat_template.jinja").is_file() and chat_template is None:
        shutil.copy(source / "chat_template.jinja", path / "chat_template.jinja")
    if chat_template is not None:
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@dataclass
class ScriptedEngine(FakeEngineClient):
    """Every sample writes the token ids of ``script(sample index)`` (one token per step), then
    EOS (``stop``); ``max_tokens`` cuts it (``length``); ``error_after`` tokens, the engine ends
    it with ``finish_reason: "error"``. ``tokenize``: text -> ids."""

    tokenize: Callable[[str], list[int]] = field(default=lambda text: [])
    texts: list[str] = field(default_factory=lambda: [""])
    error_after: int | None = None  # then finish_reason "error", as a constraint failing
    vocab_size: int = 49152
    max_model_len: int = 4096

    def script(self, index: int) -> list[int]:
        return self.tokenize(self.texts[index % len(self.texts)])

    async def _run(self, sub: Submitted) -> AsyncIterator[RequestDelta]:
        self.submitted.append(sub)
        params = sub.params
        limit = min(params.max_tokens or self.max_model_len, self.max_model_len)
        scripts = [[*self.script(j), self.info.eos_token_ids[0]] for j in range(params.n)]
        done = [False] * params.n
        step = 0
        try:
            while not all(done):
                await asyncio.sleep(self.step_delay)
                for j, ids in enumerate(scripts):
                    if done[j]:
                        continue
                    token = ids[step]
                    finish = None
                    if self.error_after is not None and step >= self.error_after:
                        done[j] = True
                        yield RequestDelta(
                            sub.request_id, j, [], None, "error", None, 0, None, "matcher failed"
                        )
                        continue
                    if step == len(ids) - 1:
                        finish = "stop"
                    elif step + 1 >= limit:
                        finish = "length"
                    done[j] = finish is not None
                    yield RequestDelta(sub.request_id, j, [token], None, finish, None, 0, None)
                step += 1
            self.finished.append(sub.request_id)
        finally:
            if not all(done):
                self.aborted.append(sub.request_id)


class ScriptedAPI:
    """An open API server (no key) on a ``ScriptedEngine`` with ``tokenizer``: ``http`` drives
    it over ASGI; ``say`` sets what the samples write."""

    def __init__(self, tokenizer: Any, model_dir: str, **settings: Any) -> None:
        import httpx

        from tests.utils.app import make_app

        def ids(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False).input_ids)

        self.engine = ScriptedEngine(model_dir=model_dir, tokenize=ids)
        self.app = make_app(self.engine, tokenizer, **settings)
        transport = httpx.ASGITransport(app=self.app)
        self.http = httpx.AsyncClient(transport=transport, base_url="http://test")

    def say(self, *texts: str) -> None:
        self.engine.texts = list(texts)

    @property
    def submitted(self) -> list[Submitted]:
        return self.engine.submitted

    async def aclose(self) -> None:
        await self.http.aclose()


@contextlib.asynccontextmanager
async def scripted_api(
    tokenizer: Any, model_dir: str, **settings: Any
) -> AsyncIterator[ScriptedAPI]:
    api = ScriptedAPI(tokenizer, model_dir, **settings)
    try:
        yield api
    finally:
        await api.aclose()
