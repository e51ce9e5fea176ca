"""OpenAI response bodies and server-sent events for chat and text completions.

The worker's chunks (`worker.protocol.TokenChunk`) carry a choice index, text, tool-call
deltas, logprobs and each choice's finish reason; a writer turns them into OpenAI's shapes,
streamed (`chunk`, then `end`) or whole (`whole`). Plain text of one choice, the hot path, is
written from a per-request byte template (only the text and the finish reason change), since
one is built per token.

Size: Every /v1 response body and stream event of chat and text completions, in OpenAI's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from worker.protocol import Finished, TokenChunk, TokenLogprob

_json = msgspec.json.encode

Kind = Literal["chat", "completion", "response"]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int  # all choices together
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
        PromptTokensDetails(cached_tokens),
    )


# The shapes below document the answers (openapi.py); they are written from dicts.
ChatFinishReason = Literal["stop", "length", "tool_calls"]
TextFinishReason = Literal["stop", "length"]


class FunctionOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionOut
    type: Literal["function"] = "function"


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class ChatMessageOut(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None  # null beside tool calls
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET
    refusal: None = None


class ChatChoice(msgspec.Struct):
    """`index`: 0..n-1, one per requested choice."""

    index: int
    message: ChatMessageOut
    finish_reason: ChatFinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: None = None


class TextLogprobs(msgspec.Struct):
    """The legacy shape: per token, its text, logprob, top alternatives and offset in the
    choice's text; with `echo`, the prompt's tokens first."""

    tokens: list[str]
    token_logprobs: list[float | None]  # with `echo`, the prompt's first token's is null
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class TextChoice(msgspec.Struct):
    """`index`: prompt_index * n + choice (0..n-1 for one prompt)."""

    index: int
    text: str  # with `echo`, the prompt first
    finish_reason: TextFinishReason
    logprobs: TextLogprobs | None = None


class TextCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: None = None


def completion_id(kind: Kind, request_id: str) -> str:
    return {"chat": "chatcmpl-", "completion": "cmpl-", "response": "resp_"}[kind] + request_id


def _top(entries: list[Any]) -> list[dict[str, Any]]:
    return [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in entries]


def chat_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """`choices[].logprobs.content[]` entries."""
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": e.bytes,
            "top_logprobs": _top(e.top_logprobs),
        }
        for e in entries
    ]


@dataclass
class Choice:
    """One choice as it accumulates (a whole answer; a stream's bookkeeping)."""

    index: int
    text: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    offset: int = 0  # completions' text_offset of the next token
    started: bool = False  # a stream sent its first delta

    def add(self, c: TokenChunk) -> None:
        if c.text:
            self.text.append(c.text)
        for d in c.tool_calls or ():
            if d.index >= len(self.calls):
                self.calls.append(
                    {
                        "id": d.id or "",
                        "type": "function",
                        "function": {"name": d.name or "", "arguments": ""},
                    }
                )
            self.calls[d.index]["function"]["arguments"] += d.arguments
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
    """The legacy shape (tokens, token_logprobs, top_logprobs, text_offset), and the offset
    after these tokens."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    # An echoed prompt's first token has no logprob, and no alternatives either (null).
    top = [
        None if e.logprob is None else {t.token: t.logprob for t in e.top_logprobs} for e in entries
    ]
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top if any(top) else None,
        "text_offset": offsets,
    }, offset


def _finish(reason: str | None, fin: Finished, index: int) -> str:
    """A choice's finish reason: its last chunk's, else the worker's Finished."""
    if reason is not None:
        return reason
    if index < len(fin.finish_reasons):
        return fin.finish_reasons[index]
    return fin.finish_reason


DONE = b"data: [DONE]\n\n"


class StreamWriter:
    """Builds one response of chat or text completions: streamed events or the whole body."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        created: int,
        model: str,
        include_usage: bool,
        n: int = 1,
        echo: list[str] | None = None,
        per_prompt: int | None = None,
    ) -> None:
        """`n`: choices of all prompts; `echo`: each prompt's text, written before its
        choices' (choice i is prompt i // per_prompt's, per_prompt defaulting to n)."""
        self.kind, self.created, self.include_usage = kind, created, include_usage
        self.request_id, self.model, self.n, self.echo = request_id, model, n, echo
        self.per_prompt = per_prompt or n
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
        self._choices = [Choice(i) for i in range(n)]

    # -- streamed ------------------------------------------------------------------------

    def delta(self, text: str, finish_reason: str | None = None, index: int = 0) -> bytes:
        """A plain-text delta of one choice (the hot path)."""
        fin = b"null" if finish_reason is None else b'"' + finish_reason.encode() + b'"'
        choice = self._choices[index]
        first, choice.started = not choice.started, True
        if self.kind == "chat":
            # The first delta carries the role (and whatever text there is); a last one may be {}.
            role = b'"role":"assistant",' if first else b""
            content = b'"content":' + _json(text) if text or first else b""
            body = (
                b'{"index":'
                + str(index).encode()
                + b',"delta":{'
                + role
                + content
                + b'},"logprobs":null,"finish_reason":'
                + fin
                + b"}"
            )
        else:
            if first and self.echo:
                text = self._echo(index) + text
            body = (
                b'{"index":'
                + str(index).encode()
                + b',"text":'
                + _json(text)
                + b',"logprobs":null,"finish_reason":'
                + fin
                + b"}"
            )
        return self._head + body + self._tail

    def _echo(self, index: int) -> str:
        """What choice `index` starts with: its prompt's text under `echo`, else ""."""
        return self.echo[index // self.per_prompt] if self.echo else ""

    def chunk(self, c: TokenChunk) -> bytes:
        """The events of one worker chunk (b"" when it says nothing to the client)."""
        if c.index >= len(self._choices):  # not a choice this request asked for
            return b""
        choice = self._choices[c.index]
        if c.tool_calls or c.logprobs:
            out = self._rich(choice, c)
        elif c.text or (not choice.started and (self.kind == "chat" or self.echo)):
            out = self.delta(c.text, index=c.index)
        else:
            out = b""
        if c.finish_reason is not None and choice.finish_reason is None:
            choice.finish_reason = c.finish_reason
            out += self.delta("", c.finish_reason, c.index)
        return out

    def _rich(self, choice: Choice, c: TokenChunk) -> bytes:
        first, choice.started = not choice.started, True
        entry: dict[str, Any] = {"index": c.index}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if c.text or (first and not c.tool_calls):
                delta["content"] = c.text
            if c.tool_calls:
                calls = []
                for d in c.tool_calls:
                    call: dict[str, Any] = {"index": d.index}
                    fn: dict[str, Any] = {"arguments": d.arguments}
                    if d.id is not None:
                        call["id"], call["type"] = d.id, "function"
                        fn["name"] = d.name or ""
                    call["function"] = fn
                    calls.append(call)
                delta["tool_calls"] = calls
            entry["delta"] = delta
            entry["logprobs"] = (
                {"content": chat_logprobs(c.logprobs), "refusal": None} if c.logprobs else None
            )
        else:
            echo = self._echo(c.index) if first else ""
            text = echo + c.text
            if echo:
                choice.offset = len(echo)
            entry["text"] = text
            lp = None
            if c.logprobs:
                lp, choice.offset = completion_logprobs(c.logprobs, choice.offset)
            entry["logprobs"] = lp
        entry["finish_reason"] = None
        return self._head + _json(entry) + self._tail

    def end(self, fin: Finished, u: Usage) -> bytes:
        """What closes a stream that ended well: finish reasons not yet sent, usage, [DONE]."""
        out = b""
        for choice in self._choices:
            if choice.finish_reason is None:
                choice.finish_reason = _finish(None, fin, choice.index)
                out += self.delta("", choice.finish_reason, choice.index)
        if self.include_usage:
            out += self.usage(u)
        return out + DONE

    def usage(self, u: Usage) -> bytes:
        return self._usage_head + _json(u) + b"}\n\n"

    def error(self, body: bytes) -> bytes:
        """An error after the stream started: the OpenAI error object as an event."""
        return b"data: " + body + b"\n\n"

    # -- whole ---------------------------------------------------------------------------

    def whole(self, chunks: list[TokenChunk], fin: Finished, u: Usage) -> bytes:
        choices = [Choice(i) for i in range(self.n)]
        for c in chunks:
            if c.index < self.n:
                choices[c.index].add(c)
        rid = completion_id(self.kind, self.request_id)
        out: list[dict[str, Any]] = []
        for ch in choices:
            text = "".join(ch.text)
            reason = _finish(ch.finish_reason, fin, ch.index)
            if self.kind == "chat":
                message: dict[str, Any] = {
                    "role": "assistant",
                    # OpenAI's null content beside tool calls
                    "content": None if ch.calls and not text else text,
                    "refusal": None,
                }
                if ch.calls:
                    message["tool_calls"] = ch.calls
                lp = (
                    {"content": chat_logprobs(ch.logprobs), "refusal": None}
                    if ch.logprobs or self._wants_logprobs(chunks)
                    else None
                )
                out.append(
                    {"index": ch.index, "message": message, "logprobs": lp, "finish_reason": reason}
                )
            else:
                echo = self._echo(ch.index)
                lp = completion_logprobs(ch.logprobs, len(echo))[0] if ch.logprobs else None
                out.append(
                    {
                        "index": ch.index,
                        "text": echo + text,
                        "logprobs": lp,
                        "finish_reason": reason,
                    }
                )
        return _json(
            {
                "id": rid,
                "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": None,
                "choices": out,
                "usage": u,
            }
        )

    @staticmethod
    def _wants_logprobs(chunks: list[TokenChunk]) -> bool:
        return any(c.logprobs is not None for c in chunks)


def full_response(
    kind: Kind, request_id: str, created: int, model: str, text: str, finish_reason: str, u: Usage
) -> bytes:
    """One choice of plain text, whole."""
    w = StreamWriter(kind, request_id, created, model, False)
    chunk = TokenChunk(
        request_id=request_id, seq=0, text=text, completion_tokens=u.completion_tokens,
        prompt_tokens=u.prompt_tokens, finish_reason=finish_reason,  # type: ignore[arg-type]
    )  # fmt: skip
    fin = Finished(
        request_id=request_id, seq=1, prompt_tokens=u.prompt_tokens, cached_tokens=0,
        completion_tokens=u.completion_tokens, finish_reason=finish_reason,  # type: ignore[arg-type]
    )  # fmt: skip
    return w.whole([chunk], fin, u)
