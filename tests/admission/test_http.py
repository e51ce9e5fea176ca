"""The limits admin endpoints and the tenant's own usage endpoint, over HTTP in process, on
the real NATS and Postgres fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

import httpx
import pytest

from control_plane.admission import tokenmill_extension
from control_plane.app import create_app
from control_plane.services import Services
from events import control
from events.usage import RequestFinished
from tests.control_plane.conftest import ADMIN_TOKEN, services  # noqa: F401 (a fixture)
from tests.control_plane.serving import served

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture()
async def http(services: Services) -> AsyncIterator[httpx.AsyncClient]:  # noqa: F811
    """The app with the governance extension over real HTTP (no admin token sent)."""
    extension = tokenmill_extension(services)
    services.extra.update(extension.extra)
    app = create_app(services, extensions=[extension])
    async with served(app) as base_url, httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        yield client


async def _tenant_with_key(c: httpx.AsyncClient, name: str) -> tuple[str, str, str]:
    tenant = (await c.post("/admin/v1/tenants", json={"name": name}, headers=ADMIN)).json()
    key = (
        await c.post(f"/admin/v1/tenants/{tenant['tenant_id']}/keys", json={}, headers=ADMIN)
    ).json()
    return tenant["tenant_id"], key["key_id"], key["key"]


async def test_limits_admin_and_own_usage(
    http: httpx.AsyncClient,
    services: Services,  # noqa: F811
) -> None:
    t1, k1, plain1 = await _tenant_with_key(http, "acme")
    t2, k2, plain2 = await _tenant_with_key(http, "globex")
    r = await http.put(
        f"/admin/v1/tenants/{t1}/limits",
        json={"token_quota": 1000, "requests_per_minute": 60},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    version = r.json()["version"]
    assert r.headers["etag"] == f'"{version}"'
    r = await http.put(
        f"/admin/v1/tenants/{t1}/keys/{k1}/limits",
        json={"max_concurrent_streams": 2},
        headers={**ADMIN, "If-Match": f'"{version}"'},
    )
    assert r.status_code == 200, r.text
    # a stale version, an unknown field, a bad cap, an unknown tenant: problem details, no 500
    stale = await http.put(
        f"/admin/v1/tenants/{t1}/limits", json={}, headers={**ADMIN, "If-Match": f'"{version}"'}
    )
    assert stale.status_code == 409 and stale.headers["content-type"].startswith(
        "application/problem+json"
    )
    assert (
        await http.put(f"/admin/v1/tenants/{t1}/limits", json={"rpm": 1}, headers=ADMIN)
    ).status_code == 400
    assert (
        await http.put(f"/admin/v1/tenants/{t1}/limits", json={"spend_cap": "x"}, headers=ADMIN)
    ).status_code == 400
    assert (
        await http.put("/admin/v1/tenants/ten_nope/limits", json={}, headers=ADMIN)
    ).status_code == 404
    assert (await http.get(f"/admin/v1/tenants/{t1}/limits")).status_code == 401
    got = (await http.get(f"/admin/v1/tenants/{t1}/limits", headers=ADMIN)).json()
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
    mine = (await http.get("/v1/usage", headers={"Authorization": f"Bearer {plain1}"})).json()
    assert mine["tenant_id"] == t1 and mine["key_id"] == k1
    tenant_policy = next(p for p in mine["policies"] if p["scope"] == "tenant")
    assert tenant_policy["total_tokens"] == 42 and tenant_policy["remaining_tokens"] == 958
    other = (await http.get("/v1/usage", headers={"Authorization": f"Bearer {plain2}"})).json()
    assert other["tenant_id"] == t2 and other["policies"] == []  # nothing of t1's
    bad = await http.get("/v1/usage", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"


async def test_limits_writes_are_conditional_and_bounded(http: httpx.AsyncClient) -> None:
    tenant, key, _ = await _tenant_with_key(http, "acme")
    url = f"/admin/v1/tenants/{tenant}/limits"
    r = await http.put(url, json={"requests_per_minute": 60}, headers=ADMIN)
    assert r.status_code == 200, r.text
    etag = r.headers["etag"]
    got = await http.get(url, headers=ADMIN)
    assert got.headers["etag"] == etag
    # If-Match: the current version wins, a stale one is a 409, a malformed one a 400.
    r = await http.put(url, json={"token_quota": 10}, headers={**ADMIN, "If-Match": etag})
    assert r.status_code == 200 and r.headers["etag"] != etag
    for header, status, reason in (
        (etag, 409, "version_mismatch"),
        ("abc", 400, "invalid_if_match"),
    ):
        r = await http.put(url, json={}, headers={**ADMIN, "If-Match": header})
        assert r.status_code == status and r.json()["reason"] == reason, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
    # Values a bigint column cannot hold, a NUL, a non-finite cap: 400 naming the field.
    for body, reason, field in (
        ({"requests_per_minute": 2**63}, "invalid_request", "requests_per_minute"),
        ({"token_quota": 2**80}, "invalid_request", "token_quota"),
        ({"sku_id": "sku\u0000"}, "invalid_string", "sku_id"),
        ({"spend_cap": "Infinity", "spend_currency": "USD"}, "invalid_spend_cap", None),
    ):
        for target in (url, f"/admin/v1/tenants/{tenant}/keys/{key}/limits"):
            r = await http.put(target, json=body, headers=ADMIN)
            assert r.status_code == 400 and r.json()["reason"] == reason, r.text
            assert r.json().get("field") == field
    r = await http.put(url, json={"requests_per_minute": 2**63 - 1}, headers=ADMIN)
    assert r.status_code == 200, r.text
