"""The HTTP protocol `tokenmill serve` runs uvicorn with: uvicorn's httptools protocol, except
that the /v1 completion routes are handed straight to their handler.

Through the app, a request passes uvicorn's proxy-headers middleware, Litestar's app (scope
set-up, exception middleware, router: path normalization, host check, route lookup) and only
then the route's own middleware and handler. On the token hot path that was ~85 us of the
~420 us between reading a request and writing it to NATS, under the benchmark's load
(docs/dataplane.md). A completion route here runs its handler under the same route-level
middleware (the refusal counter) Litestar would have run, in uvicorn's own request cycle
(keep-alive, flow control, chunked encoding, disconnects: unchanged); every other path, and
any app with app-level behaviour the shortcut would skip (CORS, allowed hosts, CSRF,
compression, before-send hooks, guards), goes through the app as before.

The protocol also holds every request to the input limits (`limits.InputLimits`: head size
and time on every path; when a completion handler starts reading its body) and closes a
connection whose request was refused half read without resetting it (docs/dataplane.md,
"Input limits")."""

from __future__ import annotations

import asyncio
import contextvars
import http
import logging
import sys
from collections.abc import Coroutine, Mapping
from typing import Any, cast

import msgspec
from litestar import Litestar
from litestar.routes import ASGIRoute
from litestar.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from control_plane.dataplane import errors
from control_plane.dataplane.asgi import BODY_IN, DIRECT_WRITES
from control_plane.dataplane.limits import InputLimits
from control_plane.dataplane.transport import resume_stepped
from control_plane.problems import PROBLEM_JSON, PROBLEM_TYPE_BASE

log = logging.getLogger("tokenmill.dataplane")


# A direct request whose body is not all in this long after its head starts anyway: it is
# refused from its head (key, declared length) without waiting for the body, and reads the
# rest itself, under the body's size and time limits. Most bodies arrive well before this.
BODY_WAIT_S = 0.05
# After a refusal that leaves part of the request unread, what still arrives is discarded for
# at most this long before the connection is closed: closing it with unread data would reset
# it, and a client still sending (as most do before reading) would never see the refusal.
LINGER_S = 5.0


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; a request for a path in `direct_routes` goes to that
    ASGI app instead of the server's app, started in the callback that read the last of its
    body (see `_run_now`). Every request's head is held to `limits` (size, time)."""

    direct_routes: Mapping[str, ASGIApp] = {}
    limits: InputLimits = InputLimits()
    # A direct request whose body is still arriving: started by `on_message_complete`, or
    # sooner (`_start_pending`).
    _body_pending: tuple[RequestResponseCycle, ASGIApp] | None = None
    _body_timer: asyncio.TimerHandle | None = None
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
        pending = self._body_pending
        if pending is not None:
            if len(pending[0].body) > HIGH_WATER_LIMIT:
                self._start_pending()  # uvicorn paused reading: the handler reads the rest
            elif self._body_timer is None:
                self._body_timer = self.loop.call_later(BODY_WAIT_S, self._start_pending)

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
        head = [STATUS_LINE[exc.status]]
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
        self._body_pending = None
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # Called for each request once its head is parsed (or, pipelined, once the one before
        # it has been answered), with the app to run it with: the server's, or uvicorn's 503
        # when `limit_concurrency` is exceeded (kept).
        cycle.transport = _LingeringTransport(self, cycle, self.transport)  # type: ignore[assignment]
        route = self.direct_routes.get(cycle.scope["path"])
        if route is None or app is not self.app:
            super()._start_asgi_task(cycle, app)
        elif not cycle.more_body:
            self._run_now(cycle, route, body_in=True)
        elif cycle.waiting_for_100_continue or self._declared > HIGH_WATER_LIMIT:
            # The client sends its body only once asked (uvicorn's `receive` asks); and uvicorn
            # stops reading past its high-water mark until the app asks for more: a body this
            # long is never all in before the handler starts reading it.
            self._run_now(cycle, route, body_in=False)
        else:
            self._body_pending = (cycle, route)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        pending = self._body_pending
        if pending is not None and pending[0] is self.cycle:
            self._body_pending = None
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            self._run_now(*pending, body_in=True)

    def _start_pending(self) -> None:
        pending, self._body_pending = self._body_pending, None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if pending is not None:
            self._run_now(*pending, body_in=False)

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started:
            # Its body is still arriving: nothing was dispatched, and waiting for it would
            # hold the server's stop for up to the read timeout.
            self.transport.close()
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._body_pending = None  # never started: nothing was dispatched
        self._cancel_timers()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def _run_now(self, cycle: RequestResponseCycle, route: ASGIApp, body_in: bool) -> None:
        """Runs the request's first step here, in the event-loop callback that parsed it, up
        to its first wait (by then auth, admission and the request's write to NATS are done);
        the rest runs as uvicorn's task would. A task would first wait its turn behind every
        callback the loop has ready (under load: other streams' tokens), which put ~0.1 ms
        between reading a request and dispatching it on a 2-core machine."""
        if body_in:
            cycle.scope[BODY_IN] = True  # type: ignore[literal-required]
        task = start_eagerly(self.loop, cycle.run_asgi(cast(Any, route)))
        if task is not None:
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)


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


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
) -> asyncio.Task[None] | None:
    """`coro`'s first step now, in a fresh context; a task runs the rest (None: it finished in
    that step). Python 3.12's eager tasks do this; on 3.11 the step is taken by hand, with no
    current task during it (nothing on the completion path before its first wait needs one)."""
    context = contextvars.copy_context()
    if sys.version_info >= (3, 12):
        task = asyncio.Task(coro, loop=loop, context=context, eager_start=True)  # type: ignore[call-arg,unused-ignore]
        return None if task.done() else task
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration:
        return None
    except BaseException:  # run_asgi answers every failure itself; this is a bug
        log.exception("a direct route's first step failed")
        return None
    return loop.create_task(resume_stepped(coro, waiting_on), context=context)


def gateway_protocol(
    direct_routes: Mapping[str, ASGIApp], limits: InputLimits | None = None
) -> type[GatewayHttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, serving `direct_routes` directly,
    holding request heads to `limits` (default: from the environment's settings)."""
    return type(
        "GatewayHttpProtocol",
        (GatewayHttpProtocol,),
        {"direct_routes": direct_routes, "limits": limits or InputLimits.from_settings()},
    )


def direct_routes(app: Litestar, handlers: Mapping[str, ASGIApp]) -> dict[str, ASGIApp]:
    """`handlers` (path -> the ASGI function a Litestar `@asgi` route of `app` at that path
    runs) as ASGI apps that skip Litestar's app level and routing: each under its route's
    middleware, with the scope keys Litestar's router would have set. Empty when `app` has
    app-level behaviour that would be skipped."""
    if (
        app.cors_config
        or app.allowed_hosts
        or app.csrf_config
        or app.compression_config
        or app.before_send
    ):
        return {}
    out: dict[str, ASGIApp] = {}
    for route in app.routes:
        handler = handlers.get(route.path)
        if handler is None or not isinstance(route, ASGIRoute):
            continue
        route_handler = route.route_handler
        if route_handler.resolve_guards():
            continue
        middleware = route_handler.resolve_middleware()
        out[route.path] = _litestar_scope(
            app,
            route_handler,
            route.path,
            _with_route_middleware(handler, middleware),
            # A streamed answer may skip the send chain when no middleware would change it.
            direct_writes=all(getattr(m, "passes_success_through", False) for m in middleware),
        )
    return out


def _litestar_scope(
    app: Litestar, route_handler: Any, path: str, handler: ASGIApp, direct_writes: bool
) -> ASGIApp:
    async def routed(scope: Scope, receive: Receive, send: Send) -> None:
        # What Litestar's app and router add to the scope (for middleware that reads them).
        scope["app"] = scope["litestar_app"] = app
        scope["route_handler"] = route_handler
        scope["path_params"] = {}
        scope["path_template"] = path
        scope[DIRECT_WRITES] = direct_writes  # type: ignore[literal-required]
        await handler(scope, receive, send)

    return routed


def _with_route_middleware(asgi_app: ASGIApp, middlewares: Any) -> ASGIApp:
    # As Litestar builds a route's middleware stack (litestar._asgi.routing_trie.mapping).
    for middleware in middlewares:
        if hasattr(middleware, "__iter__"):
            factory, kwargs = middleware
            asgi_app = factory(app=asgi_app, **kwargs)
        else:
            asgi_app = middleware(app=asgi_app)
    return asgi_app
