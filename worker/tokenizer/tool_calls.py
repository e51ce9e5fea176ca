"""Tool calls out of generated text: Qwen/Hermes `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` spans into OpenAI tool_calls, incrementally, for streaming.

`ToolCallParser.feed(text)` takes each new piece of generated text and returns what may be sent
now: content (text outside the spans) and `ToolCallDelta`s in OpenAI's streaming shape (the
first delta of a call carries its id and name, the next ones append argument text). A call is
announced once its name is known (and is one of the tools), and its arguments stream as they
are written. Text that could still become `<tool_call>` is held back until it cannot. A span
that turns out not to be a call (no name, not JSON, an unknown function) is returned as
content, markers included, when it closes or when generation ends: nothing is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from worker.structured.grammar import TOOL_CALL_END, TOOL_CALL_START


@dataclass
class ToolCallDelta:
    index: int  # the call's position in the reply
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# The head of a call as the templates write it; arguments follow the colon.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class _ValueScanner:
    """Finds where a JSON value written piece by piece ends (strings and nesting aware)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.started = self.done = False

    def feed(self, text: str) -> int:
        """How many chars of `text` belong to the value (all of them until it ends)."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                continue
            if not self.started and ch.isspace():
                continue
            self.started = True
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
            elif self.depth == 0 and (ch in ",}" or ch.isspace()):  # a bare scalar ended
                self.done = True
                return i
        return len(text)


class ToolCallParser:
    def __init__(
        self,
        tool_names: Iterable[str] | None = None,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.tool_names = set(tool_names) if tool_names is not None else None
        self.new_id = new_id
        self.calls: list[ToolCall] = []  # calls announced so far (arguments as streamed)
        self._buffer = ""  # text not yet returned
        self._in_call = False
        self._call: ToolCall | None = None  # the call being streamed
        self._scanner: _ValueScanner | None = None
        self._args_at = 0  # where the arguments start in _buffer
        self._args_seen = 0  # chars of the arguments region already scanned
        self._ws = ""  # whitespace after a call, held back

    def feed(self, text: str) -> ParsedDelta:
        return self._feed(text)

    def _separators(self, content: str, final: bool = False) -> str:
        """Whitespace between and after calls (the templates' newlines) is format, not
        content: held while it is only whitespace, dropped at the end."""
        if not self.calls or not content:
            return content
        self._ws += content
        if final and not self._ws.strip():
            self._ws = ""
        if self._ws.strip():
            content, self._ws = self._ws, ""
            return content
        return ""

    def _feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            if not self._in_call:
                start = self._buffer.find(TOOL_CALL_START)
                if start < 0:
                    hold = _partial_suffix(self._buffer, TOOL_CALL_START)
                    out.content += self._separators(self._buffer[: len(self._buffer) - hold])
                    self._buffer = self._buffer[len(self._buffer) - hold :]
                    return out
                out.content += self._separators(self._buffer[:start])
                self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
                self._in_call = True
                continue
            end = self._buffer.find(TOOL_CALL_END)
            body = self._buffer if end < 0 else self._buffer[:end]
            if self._call is None:
                self._start_call(body, out)
            if self._call is not None:
                self._stream_arguments(body, out)
            if end < 0:
                return out
            self._close_call(body, out)
            self._buffer = self._buffer[end + len(TOOL_CALL_END) :]
            self._in_call = False

    def finish(self) -> ParsedDelta:
        """Generation ended: the rest (held-back text, an unclosed span) is content, unless a
        call was already announced (then its arguments stay as written: truncated)."""
        out = ParsedDelta()
        if not self._in_call:
            out.content = self._separators(self._buffer, final=True)
            self._buffer = ""
            return out
        if self._call is None:
            out.content = TOOL_CALL_START + self._buffer
        else:
            self._stream_arguments(self._buffer, out)
            region = self._buffer[self._args_at :].strip()
            if region.startswith('"'):
                self._append_arguments(region, out)
        self._buffer, self._in_call, self._call = "", False, None
        return out

    # --- one span -----------------------------------------------------------------------

    def _start_call(self, body: str, out: ParsedDelta) -> None:
        m = _HEAD.match(body)
        if m is None:
            return
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return
        if self.tool_names is not None and name not in self.tool_names:
            return  # not one of ours: decided (as content) when the span closes
        self._call = ToolCall(self.new_id(), name, "")
        self.calls.append(self._call)
        self._scanner, self._args_at, self._args_seen = _ValueScanner(), m.end(), 0
        out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, self._call.id, name, ""))

    def _stream_arguments(self, body: str, out: ParsedDelta) -> None:
        assert self._call is not None and self._scanner is not None
        region = body[self._args_at :]
        if region.lstrip().startswith('"'):
            return  # a JSON string of JSON: its text is known only once the string is whole
        new = region[self._args_seen :]
        if not new or self._scanner.done:
            return
        taken = self._scanner.feed(new)
        self._args_seen += len(new)
        piece = new[:taken]
        if not self._call.arguments:
            piece = piece.lstrip()
        if piece:
            self._append_arguments(piece, out)

    def _append_arguments(self, piece: str, out: ParsedDelta) -> None:
        assert self._call is not None
        self._call.arguments += piece
        index = len(self.calls) - 1
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == index:
            last.arguments += piece
        else:
            out.tool_calls.append(ToolCallDelta(index, arguments=piece))

    def _close_call(self, body: str, out: ParsedDelta) -> None:
        call, self._call = self._call, None
        parsed = _parse_call(body)
        if call is None:  # never announced: a whole call at once, or content
            known = parsed is not None and (self.tool_names is None or parsed[0] in self.tool_names)
            if parsed is None or not known:
                out.content += self._separators(TOOL_CALL_START + body + TOOL_CALL_END)
                return
            call = ToolCall(self.new_id(), parsed[0], parsed[1])
            self.calls.append(call)
            out.tool_calls.append(
                ToolCallDelta(len(self.calls) - 1, call.id, call.name, call.arguments)
            )
            return
        self._call = call
        region = body[self._args_at :].strip()
        if region.startswith('"'):  # held back by _stream_arguments
            self._append_arguments(parsed[1] if parsed is not None else region, out)
        else:
            self._stream_arguments(body, out)
        self._call = None


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a whole span's body, or None if it is not a call."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        return value["name"], args
    return value["name"], json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that starts `marker` (held back: it may become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def parse_tool_calls(
    text: str, tool_names: Iterable[str] | None = None
) -> tuple[str, list[ToolCall]]:
    """A whole reply's content and calls (non-streaming)."""
    parser = ToolCallParser(tool_names)
    first, rest = parser.feed(text), parser.finish()
    return first.content + rest.content, parser.calls
