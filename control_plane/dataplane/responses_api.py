"""`POST /v1/responses`, stateless: the Responses API's request turned into the chat request the
workers run (`input` items into messages, `instructions` first), and the worker's chunks into
a Response object or its typed stream events (`response.created`, output items, text and
function-call argument deltas, `response.completed` with usage).

Nothing is stored: `store: true`, `previous_response_id` and `conversation` are refused until
stored responses exist.

Size: The Responses API's request and its events, mapped onto the chat path in one module.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

from control_plane.dataplane.errors import invalid_request
from control_plane.dataplane.requests import (
    FunctionDef,
    FunctionName,
    JsonSchemaFormat,
    MaxTokens,
    Parsed,
    ResponseFormat,
    Temperature,
    TopP,
    function_tools,
    response_format,
    tool_choice,
)
from control_plane.dataplane.responses import StreamWriter, Usage
from worker.protocol import ChatMessage, Finished, SamplingParams, TokenChunk, ToolCall


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class ResponsesBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Refused when set (below): they need stored responses or features not offered here.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: Any = None
    include: list[str] | None = None
    # Not in this API; read by the data plane's common dispatch.
    stream_options: None = None


_DECODER = msgspec.json.Decoder(ResponsesBody)


def _decode(raw: bytes) -> ResponsesBody:
    try:
        return _DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.split("`$.", 1)[1].split("`", 1)[0] if "`$." in text else None
        if param is None and "unknown field" in text:
            param = text.split("`", 2)[1] if "`" in text else None
        raise invalid_request(f"Invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_request("The request body is nested too deeply.") from None


_TEXT_PARTS = {"input_text", "output_text", "text"}


def _content(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid_request(
                    f"`{param}[{j}]`: only text parts are supported here, not {kind!r}.",
                    param=f"{param}[{j}]",
                )
            if not isinstance(part.get("text"), str):
                raise invalid_request(
                    f"`{param}[{j}].text` must be a string.", f"{param}[{j}].text"
                )
            out.append(part["text"])
        return "".join(out)
    raise invalid_request(f"`{param}` must be a string or a list of text parts.", param=param)


def _str(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid_request(f"`{param}.{key}` must be a string.", param=f"{param}.{key}")
    return value


def input_messages(body: ResponsesBody) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage("system", body.instructions))
    if isinstance(body.input, str):
        messages.append(ChatMessage("user", body.input))
        return messages
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid_request(
                    f"`{param}.role` must be user, system, developer or assistant.",
                    param=f"{param}.role",
                )
            text = _content(item.get("content"), f"{param}.content")
            messages.append(ChatMessage("system" if role == "developer" else role, text))
        elif kind == "function_call":
            call = ToolCall(
                id=_str(item, "call_id", param),
                name=_str(item, "name", param),
                arguments=_str(item, "arguments", param),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                messages[-1] = ChatMessage(
                    "assistant", last.content, tool_calls=[*last.tool_calls, call]
                )
            else:
                messages.append(ChatMessage("assistant", "", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = _content(output, f"{param}.output")
            messages.append(ChatMessage("tool", text, tool_call_id=_str(item, "call_id", param)))
        else:
            raise invalid_request(
                f"`{param}.type` {kind!r} is not supported here (message, function_call, "
                "function_call_output).",
                param=f"{param}.type",
            )
    if not messages:
        raise invalid_request("`input` must contain at least one item.", param="input")
    return messages


def parse_responses(raw: bytes) -> Parsed:
    b = _decode(raw)
    if b.store:
        raise invalid_request(
            "`store: true` is not supported: this server does not store responses yet; "
            "send `store: false`.",
            param="store",
            code="unsupported_parameter",
        )
    for name in ("previous_response_id", "conversation", "background", "reasoning", "include"):
        if getattr(b, name):
            raise invalid_request(
                f"The parameter `{name}` is not supported by this server.",
                param=name,
                code="unsupported_parameter",
            )
    if b.user is not None and "\x00" in b.user:
        raise invalid_request("`user` must not contain NUL characters.", param="user")
    tools = None
    if b.tools:
        defs = []
        for i, t in enumerate(b.tools):
            if t.type != "function" or t.name is None:
                raise invalid_request(
                    f"`tools[{i}]`: only function tools are supported here, not {t.type!r}.",
                    param=f"tools[{i}].type",
                    code="unsupported_parameter",
                )
            defs.append(FunctionDef(t.name, t.description, t.parameters, t.strict))
        tools = function_tools(defs, nested=False)
    fmt = None
    if b.text is not None and b.text.format is not None:
        f = b.text.format
        js = None
        if f.type == "json_schema":
            js = JsonSchemaFormat(f.name or "", f.schema, f.description, f.strict)
        fmt = response_format(ResponseFormat(f.type, js), param="text.format", sub="")
    choice = b.tool_choice
    named = FunctionName(choice.name) if isinstance(choice, NamedFunction) else choice
    sampling = SamplingParams(
        temperature=1.0 if b.temperature is None else b.temperature,
        top_p=1.0 if b.top_p is None else b.top_p,
        max_tokens=b.max_output_tokens,
    )
    return Parsed(
        body=b,
        sampling=sampling,
        messages=input_messages(b),
        response_format=fmt,
        tools=tools,
        tool_choice=tool_choice(named, tools),
        parallel_tool_calls=b.parallel_tool_calls is not False,
    )


# The shapes below document `input` and the Response object (openapi.py); the input is read
# from dicts (`input_messages`) and the answer written from dicts.
class InputTextPart(msgspec.Struct):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(msgspec.Struct):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]
    type: Literal["message"] = "message"


class InputFunctionCall(msgspec.Struct):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class InputFunctionCallOutput(msgspec.Struct):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]


class OutputText(msgspec.Struct):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: Literal["in_progress", "completed"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    status: Literal["in_progress", "completed"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseReasoning(msgspec.Struct):
    effort: None
    summary: None


class ResponseTextFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    name: str | msgspec.UnsetType = msgspec.UNSET
    schema: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    strict: bool | msgspec.UnsetType = msgspec.UNSET


class ResponseText(msgspec.Struct):
    format: ResponseTextFormat


class ResponseFunctionTool(msgspec.Struct):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool


class Response(msgspec.Struct):
    """The Response object: whole, or in the stream's response.* events."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: None
    reasoning: ResponseReasoning
    store: Literal[False]
    temperature: float
    text: ResponseText
    tool_choice: Literal["none", "auto", "required"] | NamedFunction
    tools: list[ResponseFunctionTool]
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


INPUT_ITEMS = (InputMessage, InputFunctionCall, InputFunctionCallOutput)


_json = msgspec.json.encode


def _item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def response_usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


class ResponsesWriter(StreamWriter):
    """A Response object, whole or as the stream of events the official clients read."""

    def __init__(self, parsed: Parsed, request_id: str, created: int, model: str) -> None:
        super().__init__("response", request_id, created, model, False)
        b: ResponsesBody = parsed.body
        self.parsed, self.body = parsed, b
        self.response_id = "resp_" + request_id
        self._seq = 0
        self._opened = False
        self._items: list[dict[str, Any]] = []  # output items, in order
        self._text_item: dict[str, Any] | None = None  # the message being written
        self._calls: dict[int, dict[str, Any]] = {}  # the worker's call index -> item

    def _response(
        self, status: str, u: Usage | None = None, reason: str | None = None
    ) -> dict[str, Any]:
        b, p = self.body, self.parsed
        choice: Any = p.tool_choice
        if not isinstance(choice, str):
            choice = {"type": "function", "name": choice.name}
        tools = [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": msgspec.json.decode(t.parameters) if t.parameters else None,
                "strict": t.strict,
            }
            for t in p.tools or []
        ]
        fmt: dict[str, Any] = {"type": "text"}
        if p.response_format is not None:
            fmt = {"type": p.response_format.type}
            if p.response_format.type == "json_schema":
                fmt.update(
                    name=p.response_format.name,
                    schema=msgspec.json.decode(p.response_format.schema or "{}"),
                    strict=p.response_format.strict,
                )
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": self._items,
            "parallel_tool_calls": p.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": p.sampling.temperature,
            "text": {"format": fmt},
            "tool_choice": choice,
            "tools": tools,
            "top_p": p.sampling.top_p,
            "truncation": "disabled",
            "usage": None if u is None else response_usage(u),
            "user": b.user,
            "metadata": b.metadata or {},
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json(data) + b"\n\n"

    def _open(self) -> bytes:
        if self._opened:
            return b""
        self._opened = True
        r = self._response("in_progress")
        return self._event("response.created", response=r) + self._event(
            "response.in_progress", response=r
        )

    def _close_text(self) -> bytes:
        item, self._text_item = self._text_item, None
        if item is None:
            return b""
        index = self._items.index(item)
        part = item["content"][0]
        item["status"] = "completed"
        return (
            self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )  # fmt: skip
            + self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )  # fmt: skip
            + self._event("response.output_item.done", output_index=index, item=item)
        )

    def _add(self, c: TokenChunk) -> bytes:
        out = b""
        if c.text:
            if self._text_item is None:
                item: dict[str, Any] = {
                    "id": _item_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": [],
                }  # fmt: skip
                self._items.append(item)
                self._text_item = item
                index = len(self._items) - 1
                part: dict[str, Any] = {
                    "type": "output_text",
                    "text": "",
                    "annotations": [],
                    "logprobs": [],
                }
                out += self._event(
                    "response.output_item.added", output_index=index, item=dict(item, content=[])
                )
                item["content"].append(part)
                out += self._event(
                    "response.content_part.added",
                    item_id=item["id"], output_index=index, content_index=0, part=dict(part),
                )  # fmt: skip
            item = self._text_item
            item["content"][0]["text"] += c.text
            out += self._event(
                "response.output_text.delta",
                item_id=item["id"], output_index=self._items.index(item), content_index=0,
                delta=c.text, logprobs=[],
            )  # fmt: skip
        for d in c.tool_calls or ():
            call = self._calls.get(d.index)
            if call is None:
                out += self._close_text()
                call = {
                    "id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": d.id or _item_id("call"), "name": d.name or "", "arguments": "",
                }  # fmt: skip
                self._calls[d.index] = call
                self._items.append(call)
                out += self._event(
                    "response.output_item.added", output_index=len(self._items) - 1, item=dict(call)
                )
            if d.arguments:
                call["arguments"] += d.arguments
                out += self._event(
                    "response.function_call_arguments.delta",
                    item_id=call["id"], output_index=self._items.index(call), delta=d.arguments,
                )  # fmt: skip
        return out

    def _close_all(self) -> bytes:
        out = self._close_text()
        for call in self._calls.values():
            if call["status"] == "completed":
                continue
            call["status"] = "completed"
            index = self._items.index(call)
            out += self._event(
                "response.function_call_arguments.done",
                item_id=call["id"], output_index=index, arguments=call["arguments"],
            )  # fmt: skip
            out += self._event("response.output_item.done", output_index=index, item=call)
        return out

    def chunk(self, c: TokenChunk) -> bytes:
        if c.index != 0:
            return b""
        return self._open() + self._add(c)

    def end(self, fin: Finished, u: Usage) -> bytes:
        out = self._open() + self._close_all()
        if fin.finish_reason == "length":
            return out + self._event(
                "response.incomplete", response=self._response("incomplete", u, "length")
            )
        return out + self._event("response.completed", response=self._response("completed", u))

    def error(self, body: bytes) -> bytes:
        err = msgspec.json.decode(body).get("error", {})
        return self._open() + self._event(
            "error", code=err.get("code"), message=err.get("message", ""), param=err.get("param")
        )

    def whole(self, chunks: list[TokenChunk], fin: Finished, u: Usage) -> bytes:
        for c in chunks:
            if c.index == 0:
                self._add(c)
        self._close_all()
        reason = fin.finish_reason
        status = "incomplete" if reason == "length" else "completed"
        return _json(self._response(status, u, reason))
