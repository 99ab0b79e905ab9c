"""The HTTP API on the fake engine: the operator key, the tiny chat template, an app, SSE bodies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex.platform.settings import ServerSettings
from loraplex.server import create_app
from tests.utils.fakes import FakeEngineClient

API_KEY = "sk-test-operator-key-0123456789"

# Each message becomes "t3 <content> t4"; the generation prompt is "t5". It refuses tool
# messages, as some real templates refuse roles they do not know; since issue 16 none reach it:
# a template that does not read ``tools`` gets tool results as user turns
# (``platform/openai/tools/template.py``).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}"
    "{% endif %}t3 {{ m['content'] }} t4 "
    "{% endfor %}{% if add_generation_prompt %}t5{% endif %}"
)


def add_chat_template(model_dir: str | Path) -> None:
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config))


def make_app(fake: FakeEngineClient, tokenizer: Any, **settings: Any) -> Any:
    return create_app(fake, ServerSettings(**settings), tokenizer=tokenizer)


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` stays a string)."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
