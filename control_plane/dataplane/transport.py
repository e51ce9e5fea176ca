"""Writing a /v1 response with as few socket writes and task hops as the server allows.

Through plain ASGI a response costs one transport write for its head (`http.response.start`)
and one per body message, and every write waits for the handler's task to run. On the token
path that is two sends, and two wake-ups of the client, before the first token, plus the
hand-over from the NATS read loop to the HTTP task. On the fast path (a request the fast
protocol started: `fast_path.uvicorn.connection`, uvicorn's request cycle with its transport
and flow control) this module:

- holds uvicorn's writes of the head and the first body and puts them out as one write (the
  messages still go through the whole ASGI `send` chain, middleware included, so every party
  sees them as usual);
- lets the first token chunk be written straight from the NATS read loop when the connection
  is not backed up (uvicorn's writes are synchronous unless it must wait for the client to
  drain, which is checked first); if a `send` does suspend anyway, the HTTP task finishes it
  before its own next write, so order is kept.

Otherwise (the fast path off, another server) it uses plain sends."""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import TYPE_CHECKING, Any

from litestar.types import Message, Receive, Scope, Send

from control_plane.dataplane.fast_path import DIRECT_WRITES, FAST_PATH

if TYPE_CHECKING:
    from control_plane.dataplane.fast_path.uvicorn import Connection

log = logging.getLogger("tokenmill.dataplane")

# The first chunk is written from the read loop only while the connection has less than this
# waiting in user space (uvicorn pauses its writers at 64 KiB); past it, the HTTP task writes,
# waiting for the client to drain like every other chunk.
READ_LOOP_WRITE_LIMIT = 16 * 1024


@types.coroutine
def resume_stepped(coro: Coroutine[Any, Any, None], waiting_on: Any) -> Generator[Any, Any, None]:
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


def _connection(scope: Scope, receive: Receive) -> Connection | None:
    if not scope.get(FAST_PATH):  # only the fast protocol sets it: its module is imported
        return None
    from control_plane.dataplane.fast_path.uvicorn import connection

    return connection(scope, receive)


class ResponseOut:
    """One response's writes: the head (`start`) goes out with the first body bytes.

    `stream`: with the scope's DIRECT_WRITES (the send chain passes a 2xx response through
    unchanged: every middleware on the route says so), a streamed response's head and its
    chunks may be written to uvicorn's transport here, as uvicorn would frame them, without the
    chain's per-message calls; its last message still goes through `send`, which completes
    the response in uvicorn (keep-alive, pipelining)."""

    def __init__(
        self, scope: Scope, send: Send, receive: Receive, start: Message, stream: bool = False
    ) -> None:
        self._send, self._start = send, start
        c = self._conn = _connection(scope, receive)
        direct = (
            stream and c is not None and scope.get(DIRECT_WRITES) and c.frames_like_uvicorn(start)
        )
        self._direct = c if direct else None
        self._gone = False  # the client hung up (`client_left`)
        self.started = False
        # A write begun in the read loop that had to wait, or its failure: settled by the HTTP
        # task before its next write.
        self._unfinished: Awaitable[None] | None = None
        self._failed: BaseException | None = None
        # Chunks taken in the read loop (`write_soon`), not yet written.
        self._soon: list[bytes] = []
        self._writing = False  # the HTTP task is inside a write that may wait
        # The cumulative token count of the last body handed to the connection (what was
        # delivered: billing follows it), and that of the bodies taken by `write_soon`.
        self.delivered_tokens = 0
        self._soon_tokens = 0
        # Looked up once: on Python 3.11 each lookup of the running loop is a getpid() call,
        # which per token was ~8% of the gateway's busy time.
        self._loop = asyncio.get_running_loop()

    @property
    def direct(self) -> bool:
        return self._direct is not None

    async def write(self, body: bytes, more_body: bool = True, tokens: int | None = None) -> None:
        """From the handler's task. `tokens`: the cumulative token count once `body` is out
        (None: no new tokens)."""
        await self._settle()
        if self._soon:
            body = self._take_soon() + body
            tokens = max(tokens or 0, self._soon_tokens)
        if more_body and self._write_direct(body):
            self._delivered(tokens)
            return
        message: Message = {"type": "http.response.body", "body": body, "more_body": more_body}
        self._writing = True
        try:
            if self.started:
                await self._send(message)
            else:
                self.started = True
                await self._start_with(message)
        finally:
            self._writing = False
        self._delivered(tokens)

    def _delivered(self, tokens: int | None) -> None:
        # A gone client's connection drops what is written to it: not delivered.
        if tokens is not None and not self.client_gone:
            self.delivered_tokens = max(self.delivered_tokens, tokens)

    @property
    def client_gone(self) -> bool:
        return self._gone or (self._conn is not None and self._conn.gone)

    def client_left(self) -> None:
        """The request's `receive` said `http.disconnect`: nothing written from now on is
        delivered."""
        self._gone = True

    def can_write_soon(self) -> bool:
        """Whether `write_soon` may take a body now: the response is written directly, has
        started, and neither the connection nor the HTTP task's own writing waits."""
        c = self._direct
        return not (
            c is None
            or not self.started
            or self._writing
            or self._unfinished is not None
            or c.stalled()
        )

    def write_soon(self, body: bytes, tokens: int = 0) -> None:
        """From the NATS read loop, when `can_write_soon()`: `body` is written on the event
        loop's next turn, with every other response's (so the bodies of one read go out after
        that read's first tokens of new responses, which are written at once), or before the
        HTTP task's next write, whichever comes first."""
        if not self._soon:
            _SOON.add(self, self._loop)
        self._soon.append(body)
        self._soon_tokens = max(self._soon_tokens, tokens)

    def _take_soon(self) -> bytes:
        body = b"".join(self._soon)
        self._soon.clear()
        return body

    def _write_soon_now(self) -> None:
        c = self._direct
        try:
            if self._soon and c is not None and not c.closed():
                body = self._take_soon()
                c.write(b"%x\r\n%b\r\n" % (len(body), body))
                self._delivered(self._soon_tokens)
        except Exception:  # a connection's failure surfaces at its HTTP task's next write
            log.exception("a response's write failed")
        self._soon.clear()

    def can_write_now(self) -> bool:
        """Whether `write_now` may start the response: it has not started, it is on the fast
        path, and the connection is neither gone nor backed up."""
        c = self._conn
        return not (self.started or c is None or c.backed_up(READ_LOOP_WRITE_LIMIT))

    def write_now(self, body: bytes, tokens: int = 0) -> None:
        """From the NATS read loop (synchronous), when `can_write_now()`: starts the response
        with `body`. A failure, or a send that had to wait, surfaces at the next `write`."""
        if self._write_direct(body):
            self._delivered(tokens)
            return
        self.started = True
        coro = self._start_with({"type": "http.response.body", "body": body, "more_body": True})
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            self._delivered(tokens)
            return
        except BaseException as exc:
            self._failed = exc
            return
        self._unfinished = resume_stepped(coro, waiting_on)
        self._delivered(tokens)  # it finishes before anything after it is written

    def _write_direct(self, body: bytes) -> bool:
        """Writes `body` (not the last) to the transport, with the head if the response has
        not started; False: use the send chain (not direct, or the connection is gone or
        backed up: `send` waits for it to drain)."""
        c = self._direct
        if c is None or c.stalled():
            return False
        parts = []
        if not self.started:
            self.started = True
            parts.append(c.head(self._start))
        if body:
            parts += (b"%x\r\n" % len(body), body, b"\r\n")
        c.write(b"".join(parts))
        return True

    async def _settle(self) -> None:
        if self._unfinished is not None:
            unfinished, self._unfinished = self._unfinished, None
            await unfinished
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    async def _start_with(self, body: Message) -> None:
        c = self._conn
        if c is None:
            await self._send(self._start)
            await self._send(body)
            return
        release = c.hold_writes()
        try:
            await self._send(self._start)
            await self._send(body)
        finally:
            release()


class _SoonWrites:
    """The responses with bodies from `write_soon`, written together by one callback on the
    loop's next turn (one callback per read, not one per response: measured cheaper)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.waiting: list[ResponseOut] = []
        self.scheduled = False

    def add(self, out: ResponseOut, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self.loop:  # first use, or another loop: what a closed one left is moot
            self.loop, self.waiting, self.scheduled = loop, [], False
        self.waiting.append(out)
        if not self.scheduled:
            self.scheduled = True
            loop.call_soon(self.write_all)

    def write_all(self) -> None:
        waiting, self.waiting, self.scheduled = self.waiting, [], False
        for out in waiting:
            out._write_soon_now()


_SOON = _SoonWrites()
