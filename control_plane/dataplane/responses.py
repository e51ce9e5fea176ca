"""OpenAI response bodies and server-sent events for chat and text completions.

Streamed chunks are written from a per-request byte template (only the text and the finish
reason change), since one is built per token on the hot path."""

from __future__ import annotations

from typing import Literal

import msgspec

_json = msgspec.json.encode

Kind = Literal["chat", "completion"]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
        PromptTokensDetails(cached_tokens),
    )


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: None = None


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str
    logprobs: None = None


class TextCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    object: str = "text_completion"
    system_fingerprint: None = None


def completion_id(kind: Kind, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def full_response(
    kind: Kind, request_id: str, created: int, model: str, text: str, finish_reason: str, u: Usage
) -> bytes:
    rid = completion_id(kind, request_id)
    if kind == "chat":
        choice = ChatChoice(0, ChatMessageOut("assistant", text), finish_reason)
        return _json(ChatCompletion(rid, created, model, [choice], u))
    return _json(TextCompletion(rid, created, model, [TextChoice(0, text, finish_reason)], u))


DONE = b"data: [DONE]\n\n"


class StreamWriter:
    """Builds the SSE events of one streamed response."""

    def __init__(
        self, kind: Kind, request_id: str, created: int, model: str, include_usage: bool
    ) -> None:
        self.kind, self.created, self.include_usage = kind, created, include_usage
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = (
            b'data: {"id":'
            + _json(completion_id(kind, request_id))
            + b',"object":"'
            + obj.encode()
            + b'","created":'
            + str(created).encode()
            + b',"model":'
            + _json(model)
            + b',"system_fingerprint":null,"choices":['
        )
        self._tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        self._usage_head = self._head + b'],"usage":'
        self._first = True

    def delta(self, text: str, finish_reason: str | None = None) -> bytes:
        fin = b"null" if finish_reason is None else b'"' + finish_reason.encode() + b'"'
        if self.kind == "chat":
            # The first delta carries the role (and whatever text there is); a last one may be {}.
            role = b'"role":"assistant",' if self._first else b""
            content = b'"content":' + _json(text) if text or self._first else b""
            choice = (
                b'{"index":0,"delta":{'
                + role
                + content
                + b'},"logprobs":null,"finish_reason":'
                + fin
                + b"}"
            )
        else:
            choice = (
                b'{"index":0,"text":'
                + _json(text)
                + b',"logprobs":null,"finish_reason":'
                + fin
                + b"}"
            )
        self._first = False
        return self._head + choice + self._tail

    def usage(self, u: Usage) -> bytes:
        return self._usage_head + _json(u) + b"}\n\n"

    @staticmethod
    def error(body: bytes) -> bytes:
        return b"data: " + body + b"\n\n"
