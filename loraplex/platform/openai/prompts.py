"""Request prompts -> token ids, off the event loop, refusing a text too long for the context
before tokenizing it.

Chat templating and tokenizing cost time linear in the prompt (seconds for megabytes). On the
event loop they would stall every other request, so both run in worker threads (the Rust
tokenizer releases the GIL while it encodes), at most ``threads`` at once, under their own
``CapacityLimiter``: a flood of large prompts waits for these threads, not for the ones the
database calls use.

Before a text is tokenized, ``max_chars_per_token`` bounds how much text one token can stand
for; a text longer than ``max_model_len`` tokens could hold at that bound needs more tokens than
the context has, and is refused (400 ``context_length_exceeded``) without tokenizing it. The
bound is sound for byte-level BPE tokenizers, where no text is dropped:

* a token stands for at most as many bytes as its byte-level string has characters (one per
  byte), and at least one byte per character of the text it covers (UTF-8 characters are 1-4
  bytes): so at most ``longest token`` characters;
* added (special) tokens match raw text (``<|im_start|>`` written in a message is one token):
  the bound also covers the longest added token;
* an NFC normalizer can compose characters: one composed character, of ``b`` bytes, comes from
  at most ``len(NFD(c))`` characters, at most 1.5 * ``b`` (Unicode's largest ratio, checked by a
  test over every code point);
* templates and special tokens only add tokens.

For any other tokenizer (one that drops whitespace, normalizes more, or maps unknown words to one
token) there is no such bound, and the text is tokenized in full (still off the loop, and bounded
by the request-body limit).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from loraplex.platform.errors import invalid_request
from loraplex.platform.openai.chat import render_chat_text, tokenize_chat
from loraplex.platform.openai.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.platform.openai.tools.template import ToolPrompt

T = TypeVar("T")

NFC_CHARS_PER_BYTE = 1.5  # max over code points c of len(NFD(c)) / len(c.encode("utf-8"))
_NORMALIZERS: dict[str | None, float] = {None: 1.0, "NFC": NFC_CHARS_PER_BYTE}
# Pre-tokenizers that split text without dropping any of it (given the behaviours below).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation"}


@dataclass(frozen=True)
class TokenBound:
    """One token stands for at most ``chars_per_token`` characters of text, counting only the
    characters ``droppable`` does not match: those holding a byte the vocabulary has no token
    for, which the tokenizer drops (SmolLM2 drops U+0004, for one) and so may cost no token."""

    chars_per_token: float
    droppable: re.Pattern[str] | None = None

    def counted(self, text: str) -> int:
        """The characters of ``text`` that need tokens."""
        return len(self.droppable.sub("", text)) if self.droppable else len(text)


def token_bound(tokenizer: Any) -> TokenBound | None:
    """How many characters of text one token can stand for, at most; None where this tokenizer
    has no such bound (see the module's docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow (Python) tokenizer: nothing to inspect
    spec = json.loads(backend.to_str())
    normalizer = spec.get("normalizer")
    ratio = _NORMALIZERS.get(normalizer["type"] if normalizer else None)
    if ratio is None or not _byte_level(spec.get("pre_tokenizer")):
        return None
    if spec.get("model", {}).get("type") != "BPE":
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    missing = {b for b, c in _byte_chars().items() if c not in vocab and _in_utf8(b)}
    if any(0x80 <= b <= 0xBF for b in missing):
        return None  # a continuation byte: too many characters hold it to list them
    longest = max(len(token) for token in vocab)
    added = backend.get_added_tokens_decoder().values()
    longest_added = max((len(t.content) for t in added), default=0)
    return TokenBound(ratio * max(longest, longest_added), _droppable(missing))


def _in_utf8(byte: int) -> bool:
    """Whether UTF-8 text can hold ``byte`` (C0, C1 and F5-FF never occur)."""
    return byte not in (0xC0, 0xC1) and byte < 0xF5


def _droppable(missing: set[int]) -> re.Pattern[str] | None:
    """The characters whose UTF-8 holds one of the ``missing`` bytes (ASCII or lead bytes)."""
    ranges = []
    for b in sorted(missing):
        if b < 0x80:
            ranges.append((b, b))
        elif b < 0xE0:  # 110xxxxx: U+0080..U+07FF, 64 code points per lead byte
            ranges.append(((b & 0x1F) << 6, ((b & 0x1F) << 6) + 0x3F))
        elif b < 0xF0:  # 1110xxxx: 4096 code points per lead byte
            ranges.append(((b & 0x0F) << 12, ((b & 0x0F) << 12) + 0xFFF))
        else:  # 11110xxx: 2^18 code points per lead byte
            ranges.append(((b & 0x07) << 18, ((b & 0x07) << 18) + 0x3FFFF))
    if not ranges:
        return None
    return re.compile("[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges) + "]")


def _byte_chars() -> dict[int, str]:
    """The byte-level alphabet: byte -> the character that stands for it in token strings
    (GPT-2's ``bytes_to_unicode``: printable bytes as themselves, the others from U+0100 on)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update({b: chr(0x100 + i) for i, b in enumerate(others)})
    return chars


def _byte_level(pre: dict[str, Any] | None) -> bool:
    """A pre-tokenizer that keeps every byte and includes the byte-level mapping."""
    if pre is None:
        return False
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") not in _KEEPING_PRE_TOKENIZERS:
            return False
        if step.get("behavior") == "Removed":
            return False
    return any(step.get("type") == "ByteLevel" for step in steps)


class Prompts:
    """Renders and tokenizes the prompts of requests in worker threads."""

    def __init__(self, threads: int) -> None:
        self._limiter = anyio.CapacityLimiter(threads)
        self._bounds: dict[int, TokenBound | None] = {}  # id(tokenizer) -> its bound

    async def run(self, work: Callable[[], T]) -> T:
        """``work`` (tokenizer work of another kind: /tokenize) in these threads."""
        return await anyio.to_thread.run_sync(work, limiter=self._limiter)

    async def completion(
        self, tokenizer: Any, body: CompletionRequest, items: list[Any], max_model_len: int
    ) -> list[list[int]]:
        """Each prompt of a completions request (text or token ids) as token ids."""
        add_special = body.add_special_tokens is not False

        def run() -> list[list[int]]:
            prompts = []
            for i, item in enumerate(items):
                param = "prompt" if len(items) == 1 else f"prompt[{i}]"
                if isinstance(item, str):
                    self._check_fits(tokenizer, item, max_model_len, param, "in the prompt")
                    ids = list(
                        tokenizer(item, add_special_tokens=add_special, verbose=False).input_ids
                    )
                else:
                    ids = list(item)
                if not ids:
                    raise invalid_request(
                        f"{param} is empty; send at least one token of text.",
                        param,
                        "empty_prompt",
                    )
                prompts.append(ids)
            return prompts

        return await anyio.to_thread.run_sync(run, limiter=self._limiter)

    async def chat(
        self,
        tokenizer: Any,
        body: ChatCompletionRequest,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        max_model_len: int,
        tools: ToolPrompt | None = None,
    ) -> list[int]:
        """A chat request's messages (and the tools offered) through the chat template, as
        token ids."""

        def run() -> list[int]:
            text = render_chat_text(
                tokenizer,
                body.messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
            )
            where = "in the messages (with the chat template)"
            self._check_fits(tokenizer, text, max_model_len, "messages", where)
            return tokenize_chat(tokenizer, text, bool(body.add_special_tokens))

        return await anyio.to_thread.run_sync(run, limiter=self._limiter)

    def _check_fits(
        self, tokenizer: Any, text: str, max_model_len: int, param: str, where: str
    ) -> None:
        """400 when ``text`` surely needs more tokens than the context holds (runs in a worker
        thread: the bound is computed there, once per tokenizer)."""
        key = id(tokenizer)
        if key not in self._bounds:
            self._bounds[key] = token_bound(tokenizer)
        bound = self._bounds[key]
        limit = max_model_len * (bound.chars_per_token if bound else 0.0)
        if bound is None or len(text) <= limit:
            return
        counted = bound.counted(text)  # O(len(text)), only for a text this long
        if counted <= limit:
            return
        per_token = bound.chars_per_token
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {counted:,} characters {where}, which take at least "
            f"{int(counted // per_token):,} tokens (one of this model's tokens stands for at "
            f"most {per_token:g} characters), so no room is left for the completion. Please "
            f"reduce the length of the {param}.",
            param,
            "context_length_exceeded",
        )
