"""Request bodies of /v1/chat/completions and /v1/completions: parsed with msgspec, every
refusal a 400 OpenAI error naming the parameter.

Parameters we do not implement are refused, not ignored: a client asking for tools or
logprobs must learn it will not get them. Those with a harmless default are accepted only at
that default (n=1, penalties 0, logprobs off, echo off)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from control_plane.dataplane.errors import OpenAIError, invalid_request
from worker.protocol import ChatMessage, SamplingParams

Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
# Bounded so every accepted number fits the worker protocol (msgpack: int64) and the engines
# (a seed is an int64 in torch and vLLM; no context is anywhere near 2**31 tokens).
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
MAX_STOP_SEQUENCES = 4


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    # Plain text is what every answer is; JSON modes and schemas are not implemented.
    type: Literal["text"]


class MessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    user: str | None = None
    # Accepted at their defaults only (checked in `_only_defaults`).
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # A bool for chat, a count for completions; typed, so nested input fails at once.
    logprobs: bool | int | None = None
    response_format: ResponseFormat | None = None
    store: Literal[False] | None = None


class ChatCompletionBody(_Common, kw_only=True, forbid_unknown_fields=True):
    messages: list[MessageIn]
    max_completion_tokens: MaxTokens | None = None
    top_logprobs: int | None = None


class CompletionBody(_Common, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[str]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


# Known OpenAI parameters this server does not implement: a clear 400 instead of "unknown".
UNSUPPORTED = {
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "logit_bias",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "service_tier",
    "metadata",
    "web_search_options",
}

# Known OpenAI parameters accepted only at values that change nothing here.
ONLY_HARMLESS = {"response_format", "store"}

_DECODERS: dict[type[msgspec.Struct], msgspec.json.Decoder[Any]] = {
    ChatCompletionBody: msgspec.json.Decoder(ChatCompletionBody),
    CompletionBody: msgspec.json.Decoder(CompletionBody),
}

_PATH = re.compile(r" - at `\$\.?([^`]*)`")


def _decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    # A body with only known fields, all valid, decodes in one pass; anything else takes the
    # slow path below, which names what is wrong.
    try:
        return _DECODERS[kind].decode(body)
    except msgspec.DecodeError:  # ValidationError included
        pass
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's own guard, raised before anything deeper is built
        raise invalid_request("The request body is nested too deeply.") from None
    if not isinstance(raw, dict):
        raise invalid_request("The request body must be a JSON object.")
    for name in raw:
        if name in UNSUPPORTED and raw[name] is not None:
            raise invalid_request(
                f"The parameter `{name}` is not supported by this server.",
                param=name,
                code="unsupported_parameter",
            )
    known = set(kind.__struct_fields__)
    for name in raw:
        if name not in known and name not in UNSUPPORTED:
            raise invalid_request(
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )
    raw = {k: v for k, v in raw.items() if k in known}
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _PATH.search(text)
        param = m.group(1) if m else None
        if param == "" or param is None:
            missing = re.search(r"missing required field `([^`]+)`", text)
            param = missing.group(1) if missing else None
        field = re.split(r"[.\[]", param or "", maxsplit=1)[0]
        code = "unsupported_parameter" if field in ONLY_HARMLESS else None
        raise invalid_request(f"Invalid request: {text}", param=param, code=code) from None


def _only_defaults(b: _Common) -> None:
    if b.user is not None and "\x00" in b.user:
        # Kept as text downstream (PostgreSQL text cannot hold NUL).
        raise invalid_request("`user` must not contain NUL characters.", param="user")
    if b.n not in (None, 1):
        raise invalid_request("Only n=1 is supported.", param="n", code="unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(b, name) not in (None, 0, 0.0):
            raise invalid_request(
                f"`{name}` is not supported by this server (only 0).",
                param=name,
                code="unsupported_parameter",
            )
    if b.logprobs not in (None, False, 0):
        raise invalid_request(
            "`logprobs` is not supported by this server.",
            param="logprobs",
            code="unsupported_parameter",
        )
    if b.stream_options is not None and not b.stream:
        raise invalid_request(
            "`stream_options` is only allowed when `stream` is true.", param="stream_options"
        )


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid_request(
            f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.", param="stop"
        )
    return stops


def _sampling(b: _Common, max_tokens: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=1.0 if b.temperature is None else b.temperature,
        top_p=1.0 if b.top_p is None else b.top_p,
        max_tokens=max_tokens,
        stop=_stops(b.stop),
        seed=b.seed,
    )


def parse_chat(body: bytes) -> tuple[ChatCompletionBody, list[ChatMessage], SamplingParams]:
    b: ChatCompletionBody = _decode(body, ChatCompletionBody)
    _only_defaults(b)
    if b.top_logprobs is not None:
        raise invalid_request(
            "`top_logprobs` is not supported by this server.",
            param="top_logprobs",
            code="unsupported_parameter",
        )
    if not b.messages:
        raise invalid_request("`messages` must contain at least one message.", param="messages")
    messages = []
    for i, m in enumerate(b.messages):
        if isinstance(m.content, list):
            content = "".join(part.text for part in m.content)
        elif m.content is None:
            if m.role != "assistant":
                raise invalid_request(
                    f"messages[{i}].content is required.", param=f"messages[{i}].content"
                )
            content = ""
        else:
            content = m.content
        # "developer" is OpenAI's newer name for the system role.
        messages.append(
            ChatMessage(role="system" if m.role == "developer" else m.role, content=content)
        )
    if (
        b.max_tokens is not None
        and b.max_completion_tokens is not None
        and b.max_tokens != b.max_completion_tokens
    ):
        raise invalid_request(
            "Give `max_completion_tokens` or `max_tokens`, not two different values.",
            param="max_tokens",
        )
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    return b, messages, _sampling(b, max_tokens)


# The legacy completions endpoint's documented default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def parse_completion(body: bytes) -> tuple[CompletionBody, str, SamplingParams]:
    b: CompletionBody = _decode(body, CompletionBody)
    _only_defaults(b)
    if b.echo:
        raise invalid_request(
            "`echo` is not supported by this server.", param="echo", code="unsupported_parameter"
        )
    if b.best_of not in (None, 1):
        raise invalid_request(
            "Only best_of=1 is supported.", param="best_of", code="unsupported_parameter"
        )
    if b.suffix:
        raise invalid_request(
            "`suffix` is not supported by this server.",
            param="suffix",
            code="unsupported_parameter",
        )
    if isinstance(b.prompt, list):
        if len(b.prompt) != 1:
            raise invalid_request("Only a single prompt per request is supported.", param="prompt")
        prompt = b.prompt[0]
    else:
        prompt = b.prompt
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if b.max_tokens is None else b.max_tokens
    return b, prompt, _sampling(b, max_tokens)


__all__ = ["OpenAIError", "parse_chat", "parse_completion"]
