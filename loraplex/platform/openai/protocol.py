"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests ignore unknown fields, as OpenAI does, except the fields of OpenAI's and vLLM's schemas
that would change the output and are not implemented: ``unsupported.UNSUPPORTED`` lists them,
and the handlers refuse them by name (the two request bodies keep unknown fields in
``model_extra`` for that check). Numbers and booleans are strict (``"n": true``,
``"temperature": "hot"`` and ``"max_tokens": 16.5`` are 400s, not coerced; ``16.0`` is the integer
16, as JSON Schema's ``integer`` says, so the published schema holds); floats must be finite; every
string must be valid Unicode (a lone surrogate escape such as ``"\\ud800"`` is refused here, before
it reaches the tokenizer). Fields marked "extension" are vLLM's, not OpenAI's.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    model_validator,
)

from loraplex.config import PRIORITY_RANGE

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
_INT64 = 2**63


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone surrogate at character {exc.start}; send valid Unicode text"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
# The length limit sits before the Unicode check: pydantic words a limit on the check's result as
# "at most 256 items" (and so a Field(max_length) on an optional Text would).
ShortText = Annotated[str, StringConstraints(max_length=256), AfterValidator(_valid_unicode)]
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # accepts JSON integers, refuses strings and booleans
Bool = Annotated[bool, Strict()]
# Any int64 passes here (the vocabulary is checked where it is known: a prompt's ids by the engine
# client, stop_token_ids by params.py); a longer number is refused here, so no message repeats a
# 4000-digit value.
TokenId = Annotated[int, Strict(), Field(ge=-_INT64, lt=_INT64)]
TokenIds = list[TokenId]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """``16.0`` is the integer 16 (as in JSON Schema, so the published schema holds); done
        here, not with a ``BeforeValidator`` on ``Int``, which would garble the schema's bounds."""
        if not isinstance(data, dict):
            return data
        fields = _int_fields(cls)
        return {k: _integral(v) if k in fields else v for k, v in data.items()}


@cache
def _int_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(n for n, f in model.model_fields.items() if _mentions_int(f.annotation))


def _mentions_int(annotation: Any) -> bool:
    return annotation is int or any(_mentions_int(a) for a in get_args(annotation))


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


class StreamOptions(_Request):
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False  # extension; refused when true (unsupported)


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: OpenAI's structured outputs (``strict`` is accepted and
    always honoured: the schema is enforced whatever it says)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: ShortText | None = None
    description: Text | None = None
    # "schema" shadows a BaseModel attribute: the field is schema_, spelled "schema" in JSON
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Request):
    type: Text
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Request):
    """What completions and chat completions share."""

    # Unknown fields are kept (``model_extra``) for ``unsupported.refuse_unsupported``.
    model_config = ConfigDict(extra="allow")

    model: Text = Field(min_length=1, max_length=256)
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    n: Int | None = Field(None, ge=1)
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: Int | None = Field(None, ge=-_INT64, lt=_INT64)
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None  # refused when non-empty: not supported
    # text, json_object or json_schema (vLLM: both endpoints); see structured.py
    response_format: ResponseFormat | None = None
    user: ShortText | None = None
    # extensions
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(None, gt=0.0)
    stop_token_ids: TokenIds | None = None
    ignore_eos: Bool | None = False
    skip_special_tokens: Bool | None = True
    include_stop_str_in_output: Bool | None = False
    # vLLM's: lower runs earlier (a tenant may not go below its max_priority)
    priority: Int | None = Field(None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    # extension: add the tokenizer's special tokens (BOS) to the prompt's text; default true
    # for completions, false for chat (the chat template writes them)
    add_special_tokens: Bool | None = None
    # extensions: vLLM's constraints (structured.py reads and bounds them). structured_outputs
    # is read by hand, so that each of its keys gets its own message.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool | None = False  # refused when true: not supported
    suffix: Text | None = None  # refused when set: not supported
    best_of: Int | None = Field(None, ge=1)  # only best_of == n


class ContentPart(_Request):
    type: Text
    text: Text | None = None


class FunctionCallIn(_Request):
    name: Text
    arguments: Text = "{}"  # a JSON object, as text (OpenAI's shape)


class ToolCallIn(_Request):
    """A call the assistant made earlier in the conversation."""

    id: Text | None = None
    type: Text = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None  # a tool message: the call it answers
    tool_calls: list[ToolCallIn] | None = None  # an assistant message: the calls it made


class FunctionDefinition(_Request):
    name: Text  # checked by tools.request (OpenAI's pattern), for a message that says it
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: Bool | None = None  # accepted; arguments are always enforced under required/named


class ToolDefinition(_Request):
    type: Text
    function: FunctionDefinition


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Text
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: Text | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None  # default true
    functions: list[Any] | None = None  # refused when non-empty: the deprecated API, use tools
    # extensions (vLLM's meaning). add_generation_prompt: end the prompt with the assistant's
    # turn opener (the template's generation prompt); false ends it where the template ends the
    # last message. continue_final_message: the last message is the assistant's, left open (not
    # closed by the template) so the model continues it; excludes add_generation_prompt: true.
    add_generation_prompt: Bool | None = True
    continue_final_message: Bool | None = False


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str  # call_<random>
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # absent without calls, as OpenAI answers
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda calls: calls is None)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraplex"
    parent: str | None = None  # the base model of an adapter; None for the base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- operator endpoints ----------------------------------------------------------------------

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$"


class LoadLoRARequest(_Request):
    lora_name: Text = Field(pattern=ADAPTER_NAME_PATTERN)
    lora_path: Text = Field(min_length=1, max_length=4096)
    pinned: Bool | None = False


class UnloadLoRARequest(_Request):
    lora_name: Text = Field(min_length=1, max_length=256)


class AdapterCard(BaseModel):
    object: Literal["lora_adapter"] = "lora_adapter"
    id: str
    parent: str
    key: str  # the adapter's content hash
    rank: int
    target_modules: list[str]
    size_bytes: int


class Deleted(BaseModel):
    id: str
    object: Literal["lora_adapter"] = "lora_adapter"
    deleted: bool = True


class Health(BaseModel):
    status: Literal["ok", "unhealthy"]
    engine: dict[str, Any]


class Version(BaseModel):
    version: str
