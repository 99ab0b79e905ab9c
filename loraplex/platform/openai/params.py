"""Request fields -> the engine's ``SamplingParams``, with the checks that give each problem a
400 naming its API field (context length in vLLM's wording, limits, unsupported fields)."""

from __future__ import annotations

from loraplex.platform.errors import APIError, invalid_request
from loraplex.platform.openai.protocol import MAX_STOP_STRINGS, SamplingFields
from loraplex.sampling_params import SamplingParams, StructuredOutputsParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's max_tokens default on /v1/completions
# The engine tests each generated token against every stop id (a tuple): a bound keeps that test
# short. vLLM has none; 256 is far more than any model's end-of-turn tokens.
MAX_STOP_TOKEN_IDS = 256


def sampling_params(
    body: SamplingFields,
    prompts: list[list[int]],
    *,
    prompt_param: str,
    max_tokens: int | None,
    tokens_param: str,
    logprobs: int | None,
    max_n: int,
    max_model_len: int,
    vocab_size: int,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's ``SamplingParams`` for a request, after the checks that need the prompts'
    lengths; every problem is a 400 naming the API field."""
    n = body.n or 1
    if n > max_n:
        raise invalid_request(
            f"n is {readable(n)}, more than the {max_n} samples this server makes for one "
            "request; ask for fewer, or send several requests.",
            "n",
            "invalid_value",
        )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_request(
            f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed; send fewer.",
            "stop",
            "invalid_value",
        )
    check_stop_token_ids(body.stop_token_ids, vocab_size)
    for ids in prompts:
        check_context(len(ids), max_tokens, max_model_len, prompt_param, tokens_param)
    try:
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,  # None: until the context is full
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            stop=stops,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens is not False,
            include_stop_str_in_output=bool(body.include_stop_str_in_output),
            structured_outputs=structured,
        )
    except ValueError as exc:
        raise params_error(exc, tokens_param) from None


def check_stop_token_ids(ids: list[int] | None, vocab_size: int) -> None:
    """400 naming ``stop_token_ids`` unless it holds at most ``MAX_STOP_TOKEN_IDS`` token ids
    of the model (0 to ``vocab_size - 1``)."""
    ids = ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid_request(
            f"stop_token_ids holds {len(ids):,} ids; at most {MAX_STOP_TOKEN_IDS} are allowed; "
            "send fewer.",
            "stop_token_ids",
            "invalid_value",
        )
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid_request(
                f"stop_token_ids[{i}] is {readable(token)}, not a token id of this model: its "
                f"vocabulary has {vocab_size} tokens, ids 0 to {vocab_size - 1}.",
                "stop_token_ids",
                "invalid_token_id",
            )


def default_max_tokens(
    default: int | None, prompts: list[list[int]], max_model_len: int
) -> int | None:
    """The max_tokens of a request that sets none: ``default`` cut to the room its longest
    prompt leaves, so a default never makes a request fail; None: up to the context."""
    if default is None:
        return None
    room = max_model_len - max(len(ids) for ids in prompts)
    return min(default, room) if room >= 1 else default  # no room: check_context refuses


def check_context(
    prompt_len: int, max_tokens: int | None, limit: int, prompt_param: str, tokens_param: str
) -> None:
    where = "in the messages" if prompt_param == "messages" else "in the prompt"
    if prompt_len >= limit:
        raise invalid_request(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} tokens {where}, which leaves no room for the completion. Please "
            f"reduce the length of the {prompt_param}.",
            prompt_param,
            "context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise invalid_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{readable(prompt_len + max_tokens)} tokens ({prompt_len} {where}, "
            f"{readable(max_tokens)} in the completion). Please reduce the length of the "
            f"{prompt_param} or set {tokens_param} "
            f"to at most {limit - prompt_len}.",
            tokens_param,
            "context_length_exceeded",
        )


def params_error(exc: ValueError, tokens_param: str) -> APIError:
    """``SamplingParams.top_p must be ...`` -> 400 with ``param`` top_p."""
    message = str(exc)
    param = None
    if message.startswith("SamplingParams."):
        message = message.removeprefix("SamplingParams.")
        param = message.split(" ", 1)[0]
        if param == "max_tokens":
            param = tokens_param
            message = tokens_param + message.removeprefix("max_tokens")
    return invalid_request(sentence(message), param, "invalid_value")


def readable(n: int) -> str:
    """``n`` for a message; a number too long to read (JSON allows 4300 digits) by its size."""
    digits = str(abs(n))
    if len(digits) <= 15:
        return str(n)
    return f"{'-' if n < 0 else ''}about 10^{len(digits) - 1}"


def sentence(message: str) -> str:
    return message if message.endswith(".") else message + "."
