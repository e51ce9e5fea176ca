"""Writes that no projection could store are refused up front; unexpected errors are still
problem details. Real NATS and Postgres (the `api` fixture)."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx
import nats.errors
import pytest
from litestar.testing import RequestFactory

from control_plane.problems import PROBLEM_JSON, handle_unexpected
from control_plane.services import Services
from events.control import TenantCreated, control_subject, encode_control
from events.projections import dead_letters


def _problem(r: httpx.Response, status: int, reason: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith(PROBLEM_JSON)
    body = r.json()
    assert body["status"] == status and body["reason"] == reason, body
    return body


async def test_unstorable_writes_are_400_naming_the_field(
    api: httpx.AsyncClient, services: Services
) -> None:
    head = await services.store.head(services.layout.control_stream)
    body = _problem(
        await api.post("/admin/v1/tenants", json={"name": "evil\u0000name"}), 400, "invalid_string"
    )
    assert body["field"] == "name"
    body = _problem(
        await api.post("/admin/v1/tenants", json={"name": "ok", "labels": {"team": "a\u0000"}}),
        400,
        "invalid_string",
    )
    assert body["field"] == "labels.team"
    sku = {"name": "s1", "model": "m", "runtime": "r", "gpu_type": "cpu"}
    body = _problem(
        await api.post("/admin/v1/skus", json={**sku, "runtime_config": {"a": [1, "\u0000"]}}),
        400,
        "invalid_string",
    )
    assert body["field"] == "runtime_config.a[1]"
    body = _problem(
        await api.post("/admin/v1/skus", json={**sku, "runtime_config": {"n": 2**64}}),
        400,
        "out_of_range",
    )
    assert body["field"] == "runtime_config.n"
    # Nothing was appended: the log holds only what the projections can apply.
    assert await services.store.head(services.layout.control_stream) == head

    tid = (await api.post("/admin/v1/tenants", json={"name": "acme"})).json()["tenant_id"]
    _problem(
        await api.put(f"/admin/v1/tenants/{tid}/labels", json={"labels": {"k": "\u0000"}}),
        400,
        "invalid_string",
    )
    r = await api.get(f"/admin/v1/tenants/{tid}", params={"consistent": "true"})
    assert r.status_code == 200, r.text
    assert (await api.get("/readyz")).status_code == 200


async def test_out_of_range_paging_is_400(api: httpx.AsyncClient) -> None:
    for params in (
        {"offset": "199947873844415967526912"},
        {"offset": str(2**63)},
        {"limit": str(2**70)},
    ):
        body = _problem(await api.get("/admin/v1/skus", params=params), 400, "invalid_request")
        assert body["field"] == next(iter(params))
    r = await api.get("/admin/v1/skus", params={"offset": str(2**63 - 1)})
    assert r.status_code == 200 and r.json()["items"] == []


@pytest.mark.parametrize(
    ("exc", "status", "reason"),
    [
        (RuntimeError("bug"), 500, "internal_error"),
        (asyncpg.ConnectionDoesNotExistError("gone"), 503, "backend_unavailable"),
        (asyncpg.CannotConnectNowError("starting up"), 503, "backend_unavailable"),
        (ConnectionRefusedError(111, "refused"), 503, "backend_unavailable"),
        (nats.errors.NoServersError(), 503, "backend_unavailable"),
        (nats.errors.TimeoutError(), 503, "timeout"),
        (asyncpg.NumericValueOutOfRangeError("out of range"), 500, "internal_error"),
    ],
)
def test_unexpected_errors_are_problem_details(exc: Exception, status: int, reason: str) -> None:
    response = handle_unexpected(RequestFactory().get("/admin/v1/tenants"), exc)
    assert response.status_code == status and response.media_type == PROBLEM_JSON
    assert response.content["reason"] == reason and response.content["status"] == status


async def test_a_dead_letter_keeps_the_api_serving_and_readyz_says_why(
    api: httpx.AsyncClient, services: Services
) -> None:
    # Appended straight to the stream, past the store's validation.
    evil = TenantCreated(tenant_id="ten_evil", name="evil\u0000name")
    await services.js.publish(
        control_subject(services.layout.prefix, "tenant", evil.tenant_id),
        encode_control(evil),
        stream=services.layout.control_stream,
    )
    r = await api.post("/admin/v1/tenants", json={"name": "acme"})
    assert r.status_code == 201, r.text
    tid = r.json()["tenant_id"]
    r = await api.get(f"/admin/v1/tenants/{tid}", params={"consistent": "true"})
    assert r.status_code == 200, r.text
    body = _problem(await api.get("/readyz"), 503, "dead_letters")
    assert body["checks"]["dead_letters"] == {"read_models": 1}
    assert "tokenmill projections dead-letters" in body["detail"]

    async with services.pool.acquire() as conn:
        (letter,) = await dead_letters.dead_letters(conn)
        await dead_letters.resolve(conn, letter["id"])
    r = await api.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"]["dead_letters"] == {}


async def test_tenant_names_are_unique(api: httpx.AsyncClient, services: Services) -> None:
    rs = await asyncio.gather(
        *(api.post("/admin/v1/tenants", json={"name": "acme"}) for _ in range(4))
    )
    assert sorted(r.status_code for r in rs) == [201, 409, 409, 409], [r.text for r in rs]
    (created,) = (r.json() for r in rs if r.status_code == 201)
    for r in rs:
        if r.status_code == 409:
            assert _problem(r, 409, "tenant_exists")["tenant_id"] == created["tenant_id"]
    # A tenant from before names were unique (a random id) still claims its name.
    await services.store.append(TenantCreated(tenant_id="ten_legacy", name="legacy"), 0)
    body = _problem(
        await api.post("/admin/v1/tenants", json={"name": "legacy"}), 409, "tenant_exists"
    )
    assert body["tenant_id"] == "ten_legacy"
    r = await api.get("/admin/v1/tenants", params={"consistent": "true"})
    assert sorted(t["name"] for t in r.json()["items"]) == ["acme", "legacy"]
