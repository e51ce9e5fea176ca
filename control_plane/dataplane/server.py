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
compression, before-send hooks, guards), goes through the app as before."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from collections.abc import Coroutine, Mapping
from typing import Any, cast

from litestar import Litestar
from litestar.routes import ASGIRoute
from litestar.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from control_plane.dataplane.asgi import DIRECT_WRITES
from control_plane.dataplane.transport import resume_stepped

log = logging.getLogger("tokenmill.dataplane")


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; a request for a path in `direct_routes` goes to that
    ASGI app instead of the server's app, started in the callback that read the last of its
    body (see `_run_now`)."""

    direct_routes: Mapping[str, ASGIApp] = {}
    # A direct request whose body is still arriving: started by `on_message_complete`.
    _body_pending: tuple[RequestResponseCycle, ASGIApp] | None = None

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # Called for each request once its head is parsed (or, pipelined, once the one before
        # it has been answered), with the app to run it with: the server's, or uvicorn's 503
        # when `limit_concurrency` is exceeded (kept).
        route = self.direct_routes.get(cycle.scope["path"])
        if route is None or app is not self.app:
            super()._start_asgi_task(cycle, app)
        elif cycle.more_body:
            self._body_pending = (cycle, route)
        else:
            self._run_now(cycle, route)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        pending = self._body_pending
        if pending is not None and pending[0] is self.cycle:
            self._body_pending = None
            self._run_now(*pending)

    def connection_lost(self, exc: Exception | None) -> None:
        self._body_pending = None  # never started: nothing was dispatched
        super().connection_lost(exc)

    def _run_now(self, cycle: RequestResponseCycle, route: ASGIApp) -> None:
        """Runs the request's first step here, in the event-loop callback that parsed it, up
        to its first wait (by then auth, admission and the request's write to NATS are done);
        the rest runs as uvicorn's task would. A task would first wait its turn behind every
        callback the loop has ready (under load: other streams' tokens), which put ~0.1 ms
        between reading a request and dispatching it on a 2-core machine."""
        task = start_eagerly(self.loop, cycle.run_asgi(cast(Any, route)))
        if task is not None:
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)


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


def gateway_protocol(direct_routes: Mapping[str, ASGIApp]) -> type[GatewayHttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, serving `direct_routes` directly."""
    return type("GatewayHttpProtocol", (GatewayHttpProtocol,), {"direct_routes": direct_routes})


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
