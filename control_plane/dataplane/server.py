"""The HTTP protocol `tokenmill serve` runs uvicorn with (`http_protocol`): uvicorn's
httptools protocol holding every request to the input limits (`limits.InputLimits`: head size
and time on every path; the body's when a completion handler reads it), and closing a
connection whose request was refused half read without resetting it (docs/dataplane.md, "Input
limits"). It overrides the protocol's parser callbacks, `send_400_response` and `shutdown`,
none of uvicorn's private (underscore) members. With the data-plane fast path on (`fast_path`,
the default), its subclass `fast_path.uvicorn.FastPathProtocol` also hands the /v1 completion
routes straight to their handler; off, every request goes through the ASGI app."""

from __future__ import annotations

import asyncio
import http
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Litestar
from litestar.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from control_plane.dataplane import errors, fast_path
from control_plane.dataplane.limits import InputLimits
from control_plane.problems import PROBLEM_JSON, PROBLEM_TYPE_BASE

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

log = logging.getLogger("tokenmill.dataplane")


# After a refusal that leaves part of the request unread, what still arrives is discarded for
# at most this long before the connection is closed: closing it with unread data would reset
# it, and a client still sending (as most do before reading) would never see the refusal.
LINGER_S = 5.0


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; every request's head is held to `limits` (size, time),
    and a refusal that leaves part of a request unread lingers (`_linger`)."""

    limits: InputLimits = InputLimits()
    # The request head being read: what arrived after the read it began in, and its deadline.
    _in_head = False
    _head_reads = 0
    _head_timer: asyncio.TimerHandle | None = None
    _declared = 0  # the content-length of the request whose head was read last
    _refusal: errors.OpenAIError | None = None
    _linger_timer: asyncio.TimerHandle | None = None
    _lingering = False

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # what follows a refusal is discarded
        continuing = self._in_head
        super().data_received(data)
        if self._lingering or self.transport.is_closing():
            return  # refused, or uvicorn refused malformed HTTP and is closing
        if self._in_head:
            # The parser keeps a head that is still arriving to itself: count the reads
            # after the one it began in (which may hold the end of the request before it);
            # a complete head is measured in `on_headers_complete`.
            if continuing:
                self._head_reads += len(data)
            if self._head_reads > self.limits.max_header_bytes:
                self._refuse(errors.header_too_large(self.limits.max_header_bytes))
                return
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(
                    self.limits.read_timeout_s, self._head_timed_out
                )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_reads = True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        # Measured once here, not per header (the hot path): one read is at most 256 KiB.
        size, declared = len(self.url), b""
        for name, value in self.headers:
            size += len(name) + len(value) + 4
            if name == b"content-length":
                declared = value
        self._declared = int(declared) if declared.isdigit() else 0
        if size > self.limits.max_header_bytes:
            self._refusal = errors.header_too_large(self.limits.max_header_bytes)
            raise _Refused()  # stops the parser; uvicorn answers through `send_400_response`
        super().on_headers_complete()
        if self.cycle is not None:
            self.linger_on_close(self.cycle)

    def linger_on_close(self, cycle: RequestResponseCycle) -> None:
        """The request cycle closes the connection through `_LingeringTransport`, so that a
        close while its body is still arriving (a refusal sent `connection: close`) lingers."""
        if not isinstance(cycle.transport, _LingeringTransport):
            cycle.transport = _LingeringTransport(self, cycle, self.transport)  # type: ignore[assignment]

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to what its parser refused (malformed HTTP), or ours.
        refusal, self._refusal = self._refusal, None
        if refusal is None and getattr(self, "url", b"").startswith(b"/v1/"):
            refusal = errors.invalid_request(msg)  # /v1 answers OpenAI error objects only
        if refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(refusal)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self._lingering:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head while the answer before it is still going out: that answer
            # may take long (a stream); the head's clock starts once it is done.
            self._head_timer = self.loop.call_later(
                self.limits.read_timeout_s, self._head_timed_out
            )
            return
        self._refuse(errors.head_timeout(self.limits.read_timeout_s))

    def _refuse(self, exc: errors.OpenAIError) -> None:
        """Answers `exc` from here (no request cycle: its head was refused) and closes: an
        OpenAI error object under /v1, problem details (as the admin API answers) elsewhere."""
        url = getattr(self, "url", b"")
        if url.startswith(b"/v1/"):
            body, media = exc.to_json(), b"application/json"
        else:
            error = exc.body.error
            reason = error.code or error.type
            problem = {
                "type": PROBLEM_TYPE_BASE + reason,
                "title": http.HTTPStatus(exc.status).phrase,
                "status": exc.status,
                "detail": error.message,
                "instance": url.partition(b"?")[0].decode("latin-1"),
                "reason": reason,
            }
            body, media = msgspec.json.encode(problem), PROBLEM_JSON.encode()
        head = [b"HTTP/1.1 %d %b\r\n" % (exc.status, http.HTTPStatus(exc.status).phrase.encode())]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        if url.startswith(b"/v1/"):
            head.append(b"x-request-id: %b\r\n" % errors.new_request_id().encode())
        head.append(
            b"content-type: %b\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (media, len(body))
        )
        self.transport.write(b"".join(head) + body)
        self._linger()

    def _linger(self) -> None:
        """No more requests on this connection: discard what arrives, close when the client
        does or after LINGER_S."""
        if self._lingering:
            return
        self._lingering = True
        self._cancel_timers()
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _cancel_timers(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started:
            # Its body is still arriving: nothing was dispatched, and waiting for it would
            # hold the server's stop for up to the read timeout.
            self.transport.close()
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)


class _Refused(Exception):
    """Raised in a parser callback to stop reading a request (`GatewayHttpProtocol._refusal`
    says why)."""


class _LingeringTransport:
    """A request cycle's view of the connection's transport: a close while the request's
    body is still arriving (a refusal sent `connection: close`) lingers instead (see
    `GatewayHttpProtocol._linger`)."""

    def __init__(
        self, protocol: GatewayHttpProtocol, cycle: RequestResponseCycle, transport: Any
    ) -> None:
        self._protocol, self._cycle, self._transport = protocol, cycle, transport
        self.write = transport.write  # the token path: no indirection
        self.get_write_buffer_size = transport.get_write_buffer_size
        self.is_closing = transport.is_closing

    def close(self) -> None:
        p = self._protocol
        if p.cycle is self._cycle and self._cycle.more_body and not self._transport.is_closing():
            p._linger()
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def http_protocol(
    app: Litestar, completion_handlers: Mapping[str, ASGIApp], limits: InputLimits | None = None
) -> type[GatewayHttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` serving `app`, holding requests to
    `limits` (default: from the environment's settings): on the fast path (`fast_path.enabled()`)
    one that serves `completion_handlers` (path -> the ASGI function of `app`'s route at that
    path) directly, else the input-limits protocol alone (every request through `app`)."""
    limits = limits or InputLimits.from_settings()
    if fast_path.enabled():
        from control_plane.dataplane.fast_path import uvicorn as fast_uvicorn  # needs this module

        return fast_uvicorn.fast_protocol(
            fast_uvicorn.direct_routes(app, completion_handlers), limits
        )
    return type("GatewayHttpProtocol", (GatewayHttpProtocol,), {"limits": limits})
