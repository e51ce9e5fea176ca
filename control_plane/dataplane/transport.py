"""Writing a /v1 response with as few socket writes and task hops as the server allows.

Through plain ASGI a response costs one transport write for its head (`http.response.start`)
and one per body message, and every write waits for the handler's task to run. On the token
path that is two sends, and two wake-ups of the client, before the first token, plus the
hand-over from the NATS read loop to the HTTP task. Under uvicorn (whose `receive` is a bound
method of the connection's request cycle, exposing its transport and flow control) this module:

- holds uvicorn's writes of the head and the first body and puts them out as one write (the
  messages still go through the whole ASGI `send` chain, middleware included, so every party
  sees them as usual);
- lets the first token chunk be written straight from the NATS read loop when the connection
  is not backed up (uvicorn's writes are synchronous unless it must wait for the client to
  drain, which is checked first); if a `send` does suspend anyway, the HTTP task finishes it
  before its own next write, so order is kept.

Under any other server (or a `receive` that is not uvicorn's) it falls back to plain sends."""

from __future__ import annotations

import logging
import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, Protocol

from litestar.types import Message, Receive, Send

log = logging.getLogger("tokenmill.dataplane")

# The first chunk is written from the read loop only while the connection has less than this
# waiting in user space (uvicorn pauses its writers at 64 KiB); past it, the HTTP task writes,
# waiting for the client to drain like every other chunk.
READ_LOOP_WRITE_LIMIT = 16 * 1024


class _Transport(Protocol):
    def write(self, data: bytes) -> None: ...
    def get_write_buffer_size(self) -> int: ...


class _Flow(Protocol):
    write_paused: bool


class _Cycle(Protocol):
    """What this module uses of uvicorn's RequestResponseCycle (httptools and h11 alike)."""

    transport: Any
    flow: _Flow
    disconnected: bool


def uvicorn_cycle(receive: Receive) -> _Cycle | None:
    cycle = getattr(receive, "__self__", None)
    if cycle is None or not type(cycle).__module__.startswith("uvicorn.protocols.http."):
        return None
    if not all(hasattr(cycle, a) for a in ("transport", "flow", "disconnected")):
        return None
    if not hasattr(cycle.flow, "write_paused"):
        return None
    return cycle  # type: ignore[no-any-return]


class _HeldWrites:
    """Stands in for the cycle's transport: writes are held and put out as one. Anything else
    asked of the transport (close, is_closing...) first puts out what is held, so order holds."""

    def __init__(self, transport: _Transport) -> None:
        self._transport = transport
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._parts.append(data)

    def flush(self) -> None:
        if self._parts:
            data = b"".join(self._parts)
            self._parts.clear()
            self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        self.flush()
        return getattr(self._transport, name)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, None], waiting_on: Any) -> Generator[Any, Any, None]:
    """Finishes, as a task would, a coroutine stepped by hand that yielded `waiting_on`."""
    while True:
        try:
            sent = yield waiting_on
        except BaseException as exc:
            try:
                waiting_on = coro.throw(exc)
            except StopIteration:
                return
        else:
            try:
                waiting_on = coro.send(sent)
            except StopIteration:
                return


class ResponseOut:
    """One response's writes: the head (`start`) goes out with the first body bytes."""

    def __init__(self, send: Send, receive: Receive, start: Message) -> None:
        self._send, self._start = send, start
        self._cycle = uvicorn_cycle(receive)
        self.started = False
        # A write begun in the read loop that had to wait, or its failure: settled by the HTTP
        # task before its next write.
        self._unfinished: Awaitable[None] | None = None
        self._failed: BaseException | None = None

    async def write(self, body: bytes, more_body: bool = True) -> None:
        """From the handler's task."""
        await self._settle()
        message: Message = {"type": "http.response.body", "body": body, "more_body": more_body}
        if self.started:
            await self._send(message)
        else:
            self.started = True
            await self._start_with(message)

    def can_write_now(self) -> bool:
        """Whether `write_now` may start the response: it has not started, the server is
        uvicorn, and the connection is neither gone nor backed up."""
        c = self._cycle
        return not (
            self.started
            or c is None
            or c.disconnected
            or c.flow.write_paused
            or c.transport.get_write_buffer_size() > READ_LOOP_WRITE_LIMIT
        )

    def write_now(self, body: bytes) -> None:
        """From the NATS read loop (synchronous), when `can_write_now()`: starts the response
        with `body`. A failure, or a send that had to wait, surfaces at the next `write`."""
        self.started = True
        coro = self._start_with({"type": "http.response.body", "body": body, "more_body": True})
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return
        except BaseException as exc:
            self._failed = exc
            return
        self._unfinished = _resume(coro, waiting_on)

    async def _settle(self) -> None:
        if self._unfinished is not None:
            unfinished, self._unfinished = self._unfinished, None
            await unfinished
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    async def _start_with(self, body: Message) -> None:
        c = self._cycle
        if c is None:
            await self._send(self._start)
            await self._send(body)
            return
        transport = c.transport
        held = c.transport = _HeldWrites(transport)
        try:
            await self._send(self._start)
            await self._send(body)
        finally:
            if c.transport is held:
                c.transport = transport
            held.flush()
