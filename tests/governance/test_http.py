"""The limits admin endpoints and the tenant's own usage endpoint, over HTTP in process, on
the real NATS and Postgres fixtures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import uvicorn

from control_plane.app import create_app
from control_plane.embedded import EmbeddedNats, free_port
from control_plane.governance import tokenmill_extension
from control_plane.services import Services
from control_plane.settings import Settings
from events import control
from events.usage import RequestFinished

ADMIN = {"Authorization": "Bearer gov-admin"}


@pytest.fixture()
async def client(
    nats_server: EmbeddedNats, database_url: str, stream_prefix: str, tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Services]]:
    settings = Settings(
        data_dir=tmp_path,
        nats_url=nats_server.url,
        database_url=database_url,
        admin_token="gov-admin",
        stream_prefix=stream_prefix,
    )
    services = await Services.connect(settings, "gov-admin")
    extension = tokenmill_extension(services)
    services.extra.update(extension.extra)
    app = create_app(services, extensions=[extension])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        yield c, services
    server.should_exit = True
    await task
    await services.close()


async def _tenant_with_key(c: httpx.AsyncClient) -> tuple[str, str, str]:
    tenant = (await c.post("/admin/v1/tenants", json={"name": "acme"}, headers=ADMIN)).json()
    key = (
        await c.post(f"/admin/v1/tenants/{tenant['tenant_id']}/keys", json={}, headers=ADMIN)
    ).json()
    return tenant["tenant_id"], key["key_id"], key["key"]


async def test_limits_admin_and_own_usage(client: tuple[httpx.AsyncClient, Services]) -> None:
    c, services = client
    t1, k1, plain1 = await _tenant_with_key(c)
    t2, k2, plain2 = await _tenant_with_key(c)
    r = await c.put(
        f"/admin/v1/tenants/{t1}/limits",
        json={"token_quota": 1000, "requests_per_minute": 60},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    version = r.json()["version"]
    r = await c.put(
        f"/admin/v1/tenants/{t1}/keys/{k1}/limits",
        json={"max_concurrent_streams": 2},
        headers={**ADMIN, "If-Match": f'"{version}"'},
    )
    assert r.status_code == 200, r.text
    # a stale version, an unknown field, a bad cap, an unknown tenant: problem details, no 500
    stale = await c.put(
        f"/admin/v1/tenants/{t1}/limits", json={}, headers={**ADMIN, "If-Match": f'"{version}"'}
    )
    assert stale.status_code == 409 and stale.headers["content-type"].startswith(
        "application/problem+json"
    )
    assert (
        await c.put(f"/admin/v1/tenants/{t1}/limits", json={"rpm": 1}, headers=ADMIN)
    ).status_code == 400
    assert (
        await c.put(f"/admin/v1/tenants/{t1}/limits", json={"spend_cap": "x"}, headers=ADMIN)
    ).status_code == 400
    assert (
        await c.put("/admin/v1/tenants/ten_nope/limits", json={}, headers=ADMIN)
    ).status_code == 404
    assert (await c.get(f"/admin/v1/tenants/{t1}/limits")).status_code == 401
    got = (await c.get(f"/admin/v1/tenants/{t1}/limits", headers=ADMIN)).json()
    assert {p["key_id"] for p in got["policies"]} == {None, k1}

    now = datetime.now(UTC)
    await services.store.publish_usage(
        RequestFinished(
            request_id="r1",
            tenant_id=t1,
            key_id=k1,
            sku_id=control.sku_id_for("m"),
            model="m",
            worker_id="w",
            prompt_tokens=30,
            completion_tokens=12,
            finish_reason="stop",
            e2e_ms=1,
            started_at=now,
            finished_at=now,
        )
    )
    admission = services.extra["admission"]
    await admission.ledger.position.wait_for(
        await services.store.head(services.layout.usage_stream), 5
    )
    mine = (await c.get("/v1/usage", headers={"Authorization": f"Bearer {plain1}"})).json()
    assert mine["tenant_id"] == t1 and mine["key_id"] == k1
    tenant_policy = next(p for p in mine["policies"] if p["scope"] == "tenant")
    assert tenant_policy["total_tokens"] == 42 and tenant_policy["remaining_tokens"] == 958
    other = (await c.get("/v1/usage", headers={"Authorization": f"Bearer {plain2}"})).json()
    assert other["tenant_id"] == t2 and other["policies"] == []  # nothing of t1's
    bad = await c.get("/v1/usage", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
