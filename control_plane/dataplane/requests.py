"""Request bodies of /v1/chat/completions and /v1/completions: parsed with msgspec, every
refusal a 400 OpenAI error naming the parameter.

Parameters we do not implement are refused, not ignored: a client asking for something it
will not get must learn so. Those with a harmless default are accepted only at that default
(penalties 0, best_of 1). Tools, response formats, logprobs, n, echo and the prompt (a
text, several, or token ids) pass through to the worker
(`worker.protocol.GenerateRequest`); what the gateway can check without the model (names,
shapes, sizes, bounds) it checks here, before anything is reserved or dispatched.

Size: Every /v1 request body with its validation: one place says what the gateway accepts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from control_plane.dataplane.errors import OpenAIError, invalid_request
from worker.protocol import ChatMessage, SamplingParams, Tool, ToolCall, ToolChoiceFunction
from worker.protocol import ResponseFormat as WorkerResponseFormat

Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
# Bounded so every accepted number fits the worker protocol (msgpack: int64) and the engines
# (a seed is an int64 in torch and vLLM; no context is anywhere near 2**31 tokens).
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
MAX_STOP_SEQUENCES = 4
# Choices per request: each is a sequence on the worker, reserved as max_tokens by admission.
MAX_N = 16
# Completions: prompts in one request, and their choices (n of each) in all.
MAX_PROMPTS = 16
MAX_CHOICES = 64
# Above every vocabulary (the largest hold ~260k): a larger id is refused before dispatch.
MAX_TOKEN_ID = 2**24
MAX_TOP_LOGPROBS = 20  # OpenAI's bound, and the worker's
MAX_TOOLS = 128  # OpenAI's bound
# A JSON schema (a tool's parameters, a response format) is compiled into a grammar on the
# worker: bounded so one request cannot hand it an arbitrarily large compile.
MAX_SCHEMA_BYTES = 64 * 1024
# OpenAI's function name rule.
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    type: Literal["function"]
    function: CalledFunction


class MessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


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
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None
    # Accepted at their defaults only (checked in `_only_defaults`).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # A bool for chat, a count (0..5, OpenAI's bound) for completions; typed, so nested
    # input fails at once.
    logprobs: bool | Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    store: Literal[False] | None = None
    response_format: ResponseFormat | None = None


class ChatCompletionBody(_Common, kw_only=True, forbid_unknown_fields=True):
    messages: list[MessageIn]
    max_completion_tokens: MaxTokens | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionBody(_Common, kw_only=True, forbid_unknown_fields=True):
    # A text, a list of texts, or token ids (one list, or a list of them).
    prompt: str | list[str | int | list[int]]
    # 0 only with `echo`: the prompt's own logprobs, nothing generated (scoring a text).
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


# Known OpenAI parameters this server does not implement: a clear 400 instead of "unknown".
UNSUPPORTED = {
    "functions",
    "function_call",
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
ONLY_HARMLESS = {"store"}

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
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(b, name) not in (None, 0, 0.0):
            raise invalid_request(
                f"`{name}` is not supported by this server (only 0).",
                param=name,
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


@dataclass
class Parsed:
    """A validated /v1 request, ready to dispatch: the prompt or messages, the sampling and
    the GenerateRequest fields of tools, formats, logprobs and choices."""

    body: Any  # the decoded body: model, stream, stream_options
    sampling: SamplingParams
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    response_format: WorkerResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1  # choices of each prompt
    echo: bool = False  # completions: the prompt is written before each choice's text
    # Completions: several text prompts, or prompts as token ids (exclusive with `prompt`).
    prompts: list[str] | None = None
    prompt_token_ids: list[list[int]] | None = None
    # The worker writes the echo (token ids, or with the prompt's logprobs), not the gateway.
    worker_echo: bool = False

    @property
    def choices(self) -> int:
        """Choices of all prompts: what admission reserves max_tokens for."""
        return self.n * len(self.prompts or self.prompt_token_ids or [""])

    def generate_fields(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "prompts": self.prompts,
            "prompt_token_ids": self.prompt_token_ids,
            "echo": self.worker_echo,
            "messages": self.messages,
            "sampling": self.sampling,
            "response_format": self.response_format,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "n": self.n,
        }


def _schema_text(schema: dict[str, Any], param: str) -> str:
    # Key order kept: it is the order the model writes properties in.
    text = msgspec.json.encode(schema).decode()
    if len(text) > MAX_SCHEMA_BYTES:
        raise invalid_request(
            f"`{param}` is {len(text)} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted.",
            param=param,
        )
    return text


def response_format(
    f: ResponseFormat | None, param: str = "response_format", sub: str = ".json_schema"
) -> WorkerResponseFormat | None:
    """`sub`: where the schema's fields sit under `param` (the Responses API has them flat)."""
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return WorkerResponseFormat(type="json_object")
    js = f.json_schema
    if js is None:
        raise invalid_request(
            "`response_format` of type json_schema needs `json_schema`.",
            param=f"{param}.json_schema",
        )
    if not _FUNCTION_NAME.match(js.name):
        raise invalid_request(
            f"`{param}{sub}.name` must be 1-64 letters, digits, underscores or dashes.",
            param=f"{param}{sub}.name",
        )
    schema = js.schema if js.schema is not None else {}
    return WorkerResponseFormat(
        type="json_schema",
        schema=_schema_text(schema, f"{param}{sub}.schema"),
        name=js.name,
        strict=bool(js.strict),
    )


def function_tools(defs: list[FunctionDef], nested: bool = True) -> list[Tool]:
    """`nested`: chat's `tools[i].function`; the Responses API's are flat (`tools[i]`)."""
    param = "tools"
    if len(defs) > MAX_TOOLS:
        raise invalid_request(f"At most {MAX_TOOLS} tools are accepted.", param=param)
    tools, seen = [], set()
    for i, f in enumerate(defs):
        where = f"{param}[{i}]" + (".function" if nested else "")
        if not _FUNCTION_NAME.match(f.name):
            raise invalid_request(
                f"`{where}.name` must be 1-64 letters, digits, underscores or dashes: "
                f"{f.name[:80]!r}.",
                param=f"{where}.name",
            )
        if f.name in seen:
            raise invalid_request(f"Two tools are named {f.name!r}.", param=f"{where}.name")
        seen.add(f.name)
        parameters = None
        if f.parameters is not None:
            if f.parameters.get("type", "object") != "object":
                raise invalid_request(
                    f"`{where}.parameters` must be a JSON Schema of type object.",
                    param=f"{where}.parameters",
                )
            parameters = _schema_text(f.parameters, f"{where}.parameters") if f.parameters else None
        tools.append(
            Tool(
                name=f.name, description=f.description, parameters=parameters, strict=bool(f.strict)
            )
        )
    return tools


def tool_choice(
    choice: Literal["none", "auto", "required"] | NamedToolChoice | FunctionName | None,
    tools: list[Tool] | None,
) -> Literal["none", "auto", "required"] | ToolChoiceFunction:
    if choice is None:
        return "auto"
    if choice == "none" or choice == "auto":
        return choice
    names = [t.name for t in tools or []]
    if not names:
        raise invalid_request(
            "`tool_choice` requires `tools`: there is no function to call.", param="tool_choice"
        )
    if choice == "required":
        return "required"
    assert not isinstance(choice, str)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name
    if name not in names:
        raise invalid_request(
            f"`tool_choice` names the function {name[:80]!r}, which is not in `tools`.",
            param="tool_choice",
        )
    return ToolChoiceFunction(name=name)


def _message(i: int, m: MessageIn) -> ChatMessage:
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
    if m.tool_calls and m.role != "assistant":
        raise invalid_request(
            f"messages[{i}]: only assistant messages carry `tool_calls`.",
            param=f"messages[{i}].tool_calls",
        )
    if m.role == "tool":
        if not m.tool_call_id:
            raise invalid_request(
                f"messages[{i}]: a tool message needs `tool_call_id`.",
                param=f"messages[{i}].tool_call_id",
            )
        return ChatMessage("tool", content, tool_call_id=m.tool_call_id, name=m.name)
    calls = None
    if m.tool_calls:
        calls = [
            ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in m.tool_calls
        ]
    # "developer" is OpenAI's newer name for the system role.
    return ChatMessage("system" if m.role == "developer" else m.role, content, tool_calls=calls)


def parse_chat(body: bytes) -> Parsed:
    b: ChatCompletionBody = _decode(body, ChatCompletionBody)
    _only_defaults(b)
    if not b.messages:
        raise invalid_request("`messages` must contain at least one message.", param="messages")
    messages = [_message(i, m) for i, m in enumerate(b.messages)]
    if (
        b.max_tokens is not None
        and b.max_completion_tokens is not None
        and b.max_tokens != b.max_completion_tokens
    ):
        raise invalid_request(
            "Give `max_completion_tokens` or `max_tokens`, not two different values.",
            param="max_tokens",
        )
    if isinstance(b.logprobs, int) and not isinstance(b.logprobs, bool):
        raise invalid_request("`logprobs` is a boolean here.", param="logprobs")
    if b.top_logprobs and not b.logprobs:
        raise invalid_request("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
    tools = function_tools([t.function for t in b.tools]) if b.tools else None
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    return Parsed(
        body=b,
        sampling=_sampling(b, max_tokens),
        messages=messages,
        response_format=response_format(b.response_format),
        tools=tools,
        tool_choice=tool_choice(b.tool_choice, tools),
        parallel_tool_calls=b.parallel_tool_calls is not False,
        logprobs=bool(b.logprobs),
        top_logprobs=b.top_logprobs or 0,
        n=b.n or 1,
    )


# The legacy completions endpoint's documented default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def parse_completion(body: bytes) -> Parsed:
    b: CompletionBody = _decode(body, CompletionBody)
    _only_defaults(b)
    if b.best_of not in (None, 1, b.n):
        raise invalid_request(
            "Only best_of equal to n is supported.", param="best_of", code="unsupported_parameter"
        )
    if b.suffix:
        raise invalid_request(
            "`suffix` is not supported by this server.",
            param="suffix",
            code="unsupported_parameter",
        )
    prompt, texts, ids = _prompts(b.prompt)
    n = b.n or 1
    count = len(texts or ids or [prompt])
    if count * n > MAX_CHOICES:
        raise invalid_request(
            f"{count} prompts x n={n} is {count * n} choices; at most {MAX_CHOICES} are "
            "accepted in one request.",
            param="n",
        )
    k = 0 if isinstance(b.logprobs, bool) or b.logprobs is None else b.logprobs
    wants_logprobs = b.logprobs is not None and b.logprobs is not False
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if b.max_tokens is None else b.max_tokens
    echo = bool(b.echo)
    if max_tokens == 0 and not echo:
        raise invalid_request(
            "`max_tokens` may be 0 only with `echo` (the prompt alone comes back).",
            param="max_tokens",
        )
    return Parsed(
        body=b,
        sampling=_sampling(b, max_tokens),
        prompt=prompt,
        prompts=texts,
        prompt_token_ids=ids,
        response_format=response_format(b.response_format),
        logprobs=wants_logprobs,
        top_logprobs=k,
        n=n,
        echo=echo,
        # The worker writes what the gateway cannot: the text of token ids, the prompt's
        # logprobs.
        worker_echo=echo and (ids is not None or wants_logprobs),
    )


def _prompts(
    prompt: str | list[str | int | list[int]],
) -> tuple[str | None, list[str] | None, list[list[int]] | None]:
    """OpenAI's four prompt shapes as (one text, several texts, token-id prompts): a string;
    a list of strings; a list of token ids (one prompt); a list of lists of them."""
    if isinstance(prompt, str):
        return prompt, None, None
    if not prompt:
        raise invalid_request("`prompt` must not be an empty list.", param="prompt")
    if len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
        raise invalid_request(
            f"`prompt` holds {len(prompt)} prompts; at most {MAX_PROMPTS} are accepted.",
            param="prompt",
        )
    if all(isinstance(x, str) for x in prompt):
        texts = [x for x in prompt if isinstance(x, str)]
        return (texts[0], None, None) if len(texts) == 1 else (None, texts, None)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return None, None, [_token_ids([x for x in prompt if isinstance(x, int)], "prompt")]
    if all(isinstance(x, list) for x in prompt):
        return (
            None,
            None,
            [_token_ids(x, f"prompt[{i}]") for i, x in enumerate(prompt) if isinstance(x, list)],
        )
    raise invalid_request(
        "`prompt` must be a string, a list of strings, a list of token ids or a list of "
        "lists of token ids, not a mix.",
        param="prompt",
    )


def _token_ids(ids: list[int], where: str) -> list[int]:
    # Bounded here by what any vocabulary holds; the worker checks its model's.
    if not ids:
        raise invalid_request(f"`{where}` must hold at least one token id.", param="prompt")
    bad = next((t for t in ids if not 0 <= t < MAX_TOKEN_ID), None)
    if bad is not None:
        raise invalid_request(
            f"`{where}` holds the token id {bad}, which no vocabulary has.", param="prompt"
        )
    return ids


__all__ = ["OpenAIError", "Parsed", "parse_chat", "parse_completion"]
