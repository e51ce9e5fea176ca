"""The HTTP protocol `tokenmill serve` runs: on the fast path the /v1 completion routes go
straight to their handler under the route's middleware (the refusal counter), every other path
through the app."""

from __future__ import annotations

import logging
from typing import Any, cast

import httpx
import pytest
import uvicorn
from litestar import Litestar, get
from litestar.config.cors import CORSConfig
from litestar.types import ASGIApp, Receive, Scope, Send

from control_plane.admission.view import GovernanceView
from control_plane.dataplane import fast_path
from control_plane.dataplane.fast_path.uvicorn import FastPathProtocol, direct_routes, fast_protocol
from control_plane.dataplane.limits import InputLimits
from control_plane.dataplane.routes import DataPlane
from control_plane.dataplane.server import GatewayHttpProtocol, http_protocol
from control_plane.observability.feed import RefusalCounter
from control_plane.observability.metrics import OpsMetrics
from events.store import StreamLayout
from tests.dataplane.harness import serving
from tests.observability.test_metrics import value


def unstarted_plane() -> DataPlane:
    # Nobody is authorized, so nothing reaches the gateway or NATS.
    return DataPlane("nats://unused", "T", GovernanceView(cast(Any, None), StreamLayout("T")))


async def test_completion_routes_skip_the_router_and_keep_the_route_middleware(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plane, metrics = unstarted_plane(), OpsMetrics()
    # Whether a handler starts inside the callback that read its request (not in a task).
    reading = [False]
    data_received = GatewayHttpProtocol.data_received

    def marking(self: GatewayHttpProtocol, data: bytes) -> None:
        reading[0] = True
        try:
            data_received(self, data)
        finally:
            reading[0] = False

    monkeypatch.setattr(GatewayHttpProtocol, "data_received", marking)
    started_while_reading: list[bool] = []

    @get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app = Litestar(route_handlers=[plane.router(), healthz], plugins=[RefusalCounter(metrics)])
    seen: list[str] = []

    def recording(path: str, handler: ASGIApp) -> ASGIApp:
        async def run(scope: Scope, receive: Receive, send: Send) -> None:
            assert scope["litestar_app"] is app and scope["route_handler"].fn is not None
            seen.append(path)
            started_while_reading.append(reading[0])
            assert (
                cast(Any, scope)["tokenmill.direct_writes"] is True
            )  # the refusal counter passes 2xx
            await handler(scope, receive, send)

        return run

    handlers = {p: recording(p, h) for p, h in plane.completion_handlers().items()}
    routes = direct_routes(app, handlers)
    assert set(routes) == {"/v1/chat/completions", "/v1/completions", "/v1/responses"}

    async with (
        serving(app, http=fast_protocol(routes, InputLimits())) as (base_url, _),
        httpx.AsyncClient(base_url=base_url) as http,
    ):
        bad_key = {"authorization": "Bearer sk-nope"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        for _ in range(2):  # one keep-alive connection, request after request
            r = await http.post("/v1/chat/completions", json=body, headers=bad_key)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        # Through the app: the models route, a trailing slash, paths outside /v1.
        assert (await http.get("/v1/models", headers=bad_key)).status_code == 401
        assert (await http.post("/v1/completions/", json={})).status_code == 401
        assert (await http.get("/healthz")).json() == {"status": "ok"}

    assert seen == ["/v1/chat/completions"] * 2 + ["/v1/completions", "/v1/chat/completions"]
    assert all(started_while_reading)
    refused = value(metrics, "tokenmill_admissions_refused_total", reason="invalid_api_key", sku="")
    assert refused == 5  # the route middleware saw every refusal, direct or not
    assert (
        value(metrics, "tokenmill_admissions_refused_total", reason="method_not_allowed", sku="")
        == 1
    )


def test_apps_with_app_level_behaviour_are_served_through_the_app() -> None:
    plane = unstarted_plane()
    app = Litestar(route_handlers=[plane.router()], cors_config=CORSConfig())
    assert direct_routes(app, plane.completion_handlers()) == {}


async def test_a_request_over_the_concurrency_limit_still_gets_uvicorns_503(
    fast_path: bool,
) -> None:
    plane = unstarted_plane()
    app = Litestar(route_handlers=[plane.router()])
    http = http_protocol(app, plane.completion_handlers())
    # One connection is the limit: the client's own already reaches it.
    async with (
        serving(app, http=http, limit_concurrency=1) as (base_url, _),
        httpx.AsyncClient(base_url=base_url) as client,
    ):
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 503 and r.text == "Service Unavailable"


def test_the_switch_picks_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    plane = unstarted_plane()
    app = Litestar(route_handlers=[plane.router()])
    monkeypatch.setenv("TOKENMILL_FAST_PATH", "0")
    assert not fast_path.enabled()
    off = http_protocol(app, plane.completion_handlers())
    assert issubclass(off, GatewayHttpProtocol) and not issubclass(off, FastPathProtocol)
    monkeypatch.setenv("TOKENMILL_FAST_PATH", "1")
    assert fast_path.enabled()  # the installed libraries are the tested ones
    assert issubclass(http_protocol(app, plane.completion_handlers()), FastPathProtocol)


def test_the_fast_path_turns_itself_off_outside_the_tested_versions(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fast_path, "TESTED", (("uvicorn", (0, 1), (0, 2)),))
    monkeypatch.setattr(fast_path, "_untested", None)
    monkeypatch.delenv("TOKENMILL_FAST_PATH", raising=False)
    with caplog.at_level(logging.WARNING, "tokenmill.dataplane"):
        assert not fast_path.enabled() and not fast_path.enabled()
    assert len(caplog.records) == 1  # said once
    assert "uvicorn 0.1.x" in caplog.text and f"uvicorn {uvicorn.__version__}" in caplog.text
