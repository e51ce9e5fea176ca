"""The one interface every worker backend implements.

A backend turns a GenerateRequest into an async iterator of `Progress`. Cancellation is
asyncio's: the worker cancels the task that iterates (or closes the iterator), and the backend
releases what the request held in its `finally` (abort the engine sequence, close the upstream
HTTP stream). Whatever the iterator yielded before that is what gets metered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from worker.protocol import GenerateRequest, TokenLogprob, ToolCallDelta


@dataclass(slots=True)
class Progress:
    text: str  # new content since the previous Progress of this choice (may be "")
    completion_tokens: int  # generated so far, all choices together
    prompt_tokens: int
    cached_tokens: int = 0
    # Set on the last one of each choice: with n > 1 the request ends once every choice has.
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    index: int = 0  # the choice (request.n > 1)
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for them
    tool_calls: list[ToolCallDelta] | None = None  # parsed out of the text (request.tools)


@dataclass(slots=True)
class Load:
    """What the worker heartbeats and the gateway routes by (docs/dataplane.md, Routing)."""

    running: int = 0  # sequences being generated
    waiting: int = 0  # accepted, not yet scheduled (the queue)
    kv_pressure: float = 0.0  # 0..1: share of the KV blocks in use


class InvalidRequest(Exception):
    """The request cannot run on this model (prompt too long, ...): nothing is metered."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code  # the OpenAI error code, when it is not implied (see Rejected.code)


def serves_one_choice(request: GenerateRequest, backend: str) -> None:
    """Refuses what a backend that writes one choice of one text prompt cannot serve: n > 1,
    several prompts, token-id prompts, the worker's echo (InvalidRequest: nothing runs, the
    client gets a 400)."""
    if request.n > 1:
        raise InvalidRequest(
            f"The {backend} backend serves n=1 only.", param="n", code="unsupported_parameter"
        )
    if request.prompts is not None or request.prompt_token_ids is not None:
        raise InvalidRequest(
            f"The {backend} backend serves one text prompt per request; send each prompt "
            "as its own request.",
            param="prompt",
            code="unsupported_parameter",
        )
    if request.echo:
        raise InvalidRequest(
            f"The {backend} backend cannot echo the prompt's tokens and logprobs.",
            param="echo",
            code="unsupported_parameter",
        )


class Backend(Protocol):
    name: str

    @property
    def capacity(self) -> int:
        """Concurrent requests it serves at full speed."""
        ...

    @property
    def max_context(self) -> int | None: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def load(self) -> Load: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[Progress]:
        """Raises InvalidRequest before yielding anything if the request cannot run."""
        ...


class StopMatcher:
    """Applies OpenAI `stop` strings to a text stream for backends whose engine does not.

    Text that could be the start of a stop string is held back until it can't be; on a match
    the text is cut before the stop string (which the client never sees)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now; sets `stopped` on a match."""
        if not self.stops:
            return text
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return buf[:cut]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """At the end of generation, the held-back text was not a stop string after all."""
        held, self._held = self._held, ""
        return held
