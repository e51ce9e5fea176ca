"""The fast path's use of uvicorn internals (see the package's docstring for why and for the
versions it is tested with).

- `FastPathProtocol`: the gateway's protocol (`server.GatewayHttpProtocol`: uvicorn's httptools
  protocol under the input limits), except that the /v1 completion routes are handed straight
  to their handler from `_start_asgi_task`. Through the app, a request passes uvicorn's
  proxy-headers middleware, Litestar's app (scope set-up, exception middleware, router: path
  normalization, host check, route lookup) and only then the route's own middleware and
  handler: on the token hot path ~85 us of the ~420 us between reading a request and writing it
  to NATS, under the benchmark's load. A completion route here runs its handler under the same
  route-level middleware (the refusal counter) Litestar would have run, in uvicorn's own request
  cycle (keep-alive, flow control, chunked encoding, disconnects: unchanged); every other path,
  and any app with app-level behaviour the shortcut would skip (CORS, allowed hosts, CSRF,
  compression, before-send hooks, guards), goes through the app as before. Its handler starts
  in the callback that read the last of its body (`start_eagerly`).
- `Connection`: what `transport.ResponseOut` writes through on a request this protocol started:
  uvicorn's request cycle (its transport, flow control and response state), and the response
  head as uvicorn's httptools cycle frames it."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, cast

from litestar import Litestar
from litestar.routes import ASGIRoute
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from control_plane.dataplane.fast_path import BODY_IN, DIRECT_WRITES, FAST_PATH
from control_plane.dataplane.limits import InputLimits
from control_plane.dataplane.server import GatewayHttpProtocol
from control_plane.dataplane.transport import resume_stepped

log = logging.getLogger("tokenmill.dataplane")

# A direct request whose body is not all in this long after its head starts anyway: it is
# refused from its head (key, declared length) without waiting for the body, and reads the
# rest itself, under the body's size and time limits. Most bodies arrive well before this.
BODY_WAIT_S = 0.05


class FastPathProtocol(GatewayHttpProtocol):
    """The gateway's protocol; a request for a path in `direct_routes` goes to that ASGI app
    instead of the server's app, started in the callback that read the last of its body (see
    `_run_now`)."""

    direct_routes: Mapping[str, ASGIApp] = {}
    # A direct request whose body is still arriving: started by `on_message_complete`, or
    # sooner (`_start_pending`).
    _body_pending: tuple[RequestResponseCycle, ASGIApp] | None = None
    _body_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        pending = self._body_pending
        if pending is None or self._lingering or self.transport.is_closing():
            return
        if len(pending[0].body) > HIGH_WATER_LIMIT:
            self._start_pending()  # uvicorn paused reading: the handler reads the rest
        elif self._body_timer is None:
            self._body_timer = self.loop.call_later(BODY_WAIT_S, self._start_pending)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # Called for each request once its head is parsed (or, pipelined, once the one before
        # it has been answered), with the app to run it with: the server's, or uvicorn's 503
        # when `limit_concurrency` is exceeded (kept).
        self.linger_on_close(cycle)
        cycle.scope[FAST_PATH] = True  # type: ignore[literal-required]
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

    def _cancel_timers(self) -> None:
        super()._cancel_timers()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._body_pending = None  # never started: nothing was dispatched

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


def fast_protocol(
    direct_routes: Mapping[str, ASGIApp], limits: InputLimits
) -> type[FastPathProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, serving `direct_routes` directly and
    holding requests to `limits`."""
    return type(
        "FastPathProtocol",
        (FastPathProtocol,),
        {"direct_routes": direct_routes, "limits": limits},
    )


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


class _HeldWrites:
    """Stands in for the cycle's transport: writes are held and put out as one. Anything else
    asked of the transport (close, is_closing...) first puts out what is held, so order holds."""

    def __init__(self, transport: Any) -> None:
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


# Headers that change how uvicorn frames a response: a response that sets one is left to it.
_FRAMING_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


class Connection:
    """A request's uvicorn request cycle (found through `receive`, a bound method of it), as
    `transport.ResponseOut` writes to it."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    @property
    def gone(self) -> bool:
        return bool(self._cycle.disconnected)

    def closed(self) -> bool:
        """The client is gone, or the response is complete: nothing more may be written."""
        c = self._cycle
        return bool(c.disconnected or c.response_complete)

    def stalled(self) -> bool:
        """`closed()`, or uvicorn paused its writers (the client does not read): nothing may be
        written past `send`, which waits for the drain."""
        c = self._cycle
        return bool(c.disconnected or c.flow.write_paused or c.response_complete)

    def backed_up(self, limit: int) -> bool:
        """Gone, paused, or more than `limit` bytes waiting in user space."""
        c = self._cycle
        return bool(
            c.disconnected or c.flow.write_paused or c.transport.get_write_buffer_size() > limit
        )

    def write(self, data: bytes) -> None:
        self._cycle.transport.write(data)

    def hold_writes(self) -> Callable[[], None]:
        """Holds the cycle's writes until the returned function is called, then puts them out
        as one write."""
        c = self._cycle
        transport = c.transport
        held = c.transport = _HeldWrites(transport)

        def release() -> None:
            if c.transport is held:
                c.transport = transport
            held.flush()

        return release

    def frames_like_uvicorn(self, message: Message) -> bool:
        """Whether `head` writes what uvicorn's httptools cycle would for `start`: a chunked
        response to a non-HEAD request, no access log to write."""
        cycle, start = self._cycle, cast("dict[str, Any]", message)
        return (
            type(cycle).__module__ == "uvicorn.protocols.http.httptools_impl"
            and all(
                hasattr(cycle, a)
                for a in ("default_headers", "keep_alive", "response_started", "chunked_encoding")
            )
            and not _access_logged(cycle)
            and getattr(cycle, "scope", {}).get("method") != "HEAD"
            and start.get("status") in STATUS_LINE
            and not any(name.lower() in _FRAMING_HEADERS for name, _ in start.get("headers", []))
        )

    def head(self, message: Message) -> bytes:
        """The response head uvicorn's `send` would write for `start` (headers our own, so not
        re-validated), with the cycle marked started and chunked as uvicorn's `send` leaves
        it."""
        cycle, start = self._cycle, cast("dict[str, Any]", message)
        content = [STATUS_LINE[start["status"]]]
        for name, value in (*cycle.default_headers, *start.get("headers", [])):
            content += (name.lower(), b": ", value, b"\r\n")
        if not cycle.keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"transfer-encoding: chunked\r\n\r\n")
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = True
        cycle.expected_content_length = 0
        return b"".join(content)


def connection(scope: Scope, receive: Receive) -> Connection | None:
    """The request's uvicorn cycle, when `FastPathProtocol` started the request (its scope's
    FAST_PATH) and `receive` is still the cycle's own (a middleware's `receive` that wraps
    another says so with `__wrapped__`); None: plain ASGI sends."""
    if not scope.get(FAST_PATH):
        return None
    while (inner := getattr(receive, "__wrapped__", None)) is not None:
        receive = inner
    cycle = getattr(receive, "__self__", None)
    if cycle is None or not type(cycle).__module__.startswith("uvicorn.protocols.http."):
        return None
    if not all(hasattr(cycle, a) for a in ("transport", "flow", "disconnected")):
        return None
    if not hasattr(cycle.flow, "write_paused"):
        return None
    return Connection(cycle)


def _access_logged(cycle: Any) -> bool:
    # uvicorn's `send` logs each response start at INFO on its access logger.
    logger = getattr(cycle, "access_logger", None)
    return bool(getattr(cycle, "access_log", True)) and (
        logger is None or logger.isEnabledFor(logging.INFO)
    )
