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

from collections.abc import Mapping
from typing import Any

from litestar import Litestar
from litestar.routes import ASGIRoute
from litestar.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; a request for a path in `direct_routes` goes to that
    ASGI app instead of the server's app."""

    direct_routes: Mapping[str, ASGIApp] = {}

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # Called for each request once its head is parsed, with the app to run it with: the
        # server's, or uvicorn's 503 when `limit_concurrency` is exceeded (kept).
        route: Any = self.direct_routes.get(cycle.scope["path"])
        super()._start_asgi_task(cycle, route if route is not None and app is self.app else app)


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
        out[route.path] = _litestar_scope(
            app, route_handler, route.path, _with_route_middleware(handler, route_handler)
        )
    return out


def _litestar_scope(app: Litestar, route_handler: Any, path: str, handler: ASGIApp) -> ASGIApp:
    async def routed(scope: Scope, receive: Receive, send: Send) -> None:
        # What Litestar's app and router add to the scope (for middleware that reads them).
        scope["app"] = scope["litestar_app"] = app
        scope["route_handler"] = route_handler
        scope["path_params"] = {}
        scope["path_template"] = path
        await handler(scope, receive, send)

    return routed


def _with_route_middleware(asgi_app: ASGIApp, route_handler: Any) -> ASGIApp:
    # As Litestar builds a route's middleware stack (litestar._asgi.routing_trie.mapping).
    for middleware in route_handler.resolve_middleware():
        if hasattr(middleware, "__iter__"):
            factory, kwargs = middleware
            asgi_app = factory(app=asgi_app, **kwargs)
        else:
            asgi_app = middleware(app=asgi_app)
    return asgi_app
