"""Refusals on /v1 counted by their OpenAI error code, whichever way the data plane answers:
the completion routes write their own error responses at the ASGI level, /v1/models raises
into Litestar's exception handlers. The real data-plane router, with no governance state."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from litestar import Litestar, get
from litestar.testing import AsyncTestClient

from control_plane.admission.view import GovernanceView
from control_plane.dataplane.routes import DataPlane
from control_plane.observability.feed import RefusalCounter, refusal_reason
from control_plane.observability.metrics import OpsMetrics
from events.store import StreamLayout
from tests.observability.test_metrics import value


@pytest.fixture()
def metrics() -> OpsMetrics:
    return OpsMetrics()


@pytest.fixture()
async def client(metrics: OpsMetrics) -> AsyncIterator[AsyncTestClient]:
    # Unstarted: nobody is authorized, so nothing reaches the gateway or NATS.
    plane = DataPlane("nats://unused", "T", GovernanceView(cast(Any, None), StreamLayout("T")))

    @get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app = Litestar(route_handlers=[plane.router(), healthz], plugins=[RefusalCounter(metrics)])
    async with AsyncTestClient(app) as c:
        yield c


def refusals(metrics: OpsMetrics, reason: str) -> float | None:
    return value(metrics, "tokenmill_admissions_refused_total", reason=reason, sku="")


async def test_each_refusal_counts_once_by_its_error_code(
    client: AsyncTestClient, metrics: OpsMetrics
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    bad_key = {"Authorization": "Bearer sk-nope"}
    r = await client.post("/v1/chat/completions", json=body, headers=bad_key)  # ASGI handler
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    await client.post("/v1/completions", json={"model": "m", "prompt": "x"})  # no key at all
    assert (await client.get("/v1/models", headers=bad_key)).status_code == 401  # raised
    assert refusals(metrics, "invalid_api_key") == 3

    assert (await client.get("/v1/chat/completions")).status_code == 405
    assert refusals(metrics, "method_not_allowed") == 1

    assert (await client.get("/healthz")).status_code == 200  # outside /v1: not watched
    text = metrics.exposition().decode()
    assert (
        sum(
            1
            for line in text.splitlines()
            if line.startswith("tokenmill_admissions_refused_total{")
        )
        == 2
    )


def test_reason_falls_back_to_type_then_status() -> None:
    assert refusal_reason(429, b'{"error": {"code": "rate_limit_exceeded", "type": "t"}}') == (
        "rate_limit_exceeded"
    )
    assert refusal_reason(400, b'{"error": {"code": null, "type": "invalid_request_error"}}') == (
        "invalid_request_error"
    )
    assert refusal_reason(404, b"Not Found") == "http_404"


async def test_a_refusal_is_labelled_with_the_sku_the_request_body_names() -> None:
    """After the body is read (rate limits, quotas, no worker), a refusal names the SKU the
    request asked for, when it is one; a key refused from the head alone has no body read."""
    from litestar.types import Receive, Scope, Send

    async def refusing(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        status = 200 if b"ok" in body else 429
        await send({"type": "http.response.start", "status": status, "headers": []})
        code = b"" if status == 200 else b'{"error": {"code": "rate_limit_exceeded"}}'
        await send({"type": "http.response.body", "body": code})

    metrics = OpsMetrics()
    known = {"qwen3.6-27b": "qwen3.6-27b"}
    wrapped = RefusalCounter(metrics, known.get).middleware(refusing)

    async def call(body: bytes, chunk: int = 7) -> None:
        parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
        messages = [
            {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
            for i, p in enumerate(parts)
        ]

        async def receive() -> Any:
            return messages.pop(0)

        async def send(_: Any) -> None:
            return None

        scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST"}
        await wrapped(cast(Any, scope), receive, send)

    await call(b'{"model": "qwen3.6-27b", "messages": []}')
    await call(b'{"messages": [], "model": "qwen3.6-27b"}', chunk=3)
    await call(b'{"model": "made-up-model"}')  # not a SKU: no label of its own
    await call(b"not json")
    await call(b'{"model": "qwen3.6-27b", "ok": 1}')  # answered: not a refusal

    def count(sku: str) -> float | None:
        return value(
            metrics, "tokenmill_admissions_refused_total", reason="rate_limit_exceeded", sku=sku
        )

    assert count("qwen3.6-27b") == 2
    assert count("") == 2
    assert count("made-up-model") is None
