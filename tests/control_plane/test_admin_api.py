"""The admin API over real HTTP, on real NATS and Postgres."""

from __future__ import annotations

import asyncio
import hashlib

import asyncpg
import httpx

from control_plane.services import Services


def _problem(r: httpx.Response, status: int, reason: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["status"] == status and body["reason"] == reason
    assert {"type", "title", "detail"} <= body.keys()
    return body


async def test_tenant_lifecycle(api: httpx.AsyncClient) -> None:
    r = await api.post("/admin/v1/tenants", json={"name": "acme", "labels": {"team": "ml"}})
    assert r.status_code == 201, r.text
    tenant = r.json()
    tid = tenant["tenant_id"]
    assert tenant["status"] == "active" and tenant["labels"] == {"team": "ml"}
    assert r.headers["etag"] == f'"{tenant["version"]}"'

    r = await api.get(f"/admin/v1/tenants/{tid}", params={"consistent": "true"})
    assert r.status_code == 200 and r.json()["name"] == "acme"

    r = await api.post(f"/admin/v1/tenants/{tid}/suspend", json={"reason": "unpaid"})
    assert r.status_code == 200 and r.json()["status"] == "suspended"
    _problem(await api.post(f"/admin/v1/tenants/{tid}/suspend"), 409, "tenant_suspended")

    r = await api.get("/admin/v1/tenants", params={"consistent": "true", "status": "suspended"})
    assert [t["tenant_id"] for t in r.json()["items"]] == [tid]
    assert r.json()["items"][0]["suspended_reason"] == "unpaid"

    r = await api.post(f"/admin/v1/tenants/{tid}/reactivate")
    assert r.json()["status"] == "active"
    r = await api.put(f"/admin/v1/tenants/{tid}/labels", json={"labels": {"team": "infra"}})
    assert r.json()["labels"] == {"team": "infra"}
    r = await api.get(f"/admin/v1/tenants/{tid}", params={"consistent": "true"})
    assert r.json()["labels"] == {"team": "infra"} and r.json()["status"] == "active"


async def test_api_keys(api: httpx.AsyncClient, services: Services) -> None:
    tid = (await api.post("/admin/v1/tenants", json={"name": "acme"})).json()["tenant_id"]
    await api.post(
        "/admin/v1/skus",
        json={
            "name": "qwen3.6-27b",
            "model": "Qwen/Qwen3.6-27B",
            "runtime": "tokenmill",
            "gpu_type": "H200",
        },
    )
    r = await api.post(
        f"/admin/v1/tenants/{tid}/keys", json={"name": "ci", "scopes": ["qwen3.6-27b"]}
    )
    assert r.status_code == 201, r.text
    issued = r.json()
    plaintext = issued["key"]
    assert plaintext.startswith(issued["prefix"] + "_") and issued["prefix"].startswith("tm_")
    # Only the hash is kept: in the view (hot path) and in the read model.
    key = services.view.key_by_hash(hashlib.sha256(plaintext.encode()).hexdigest())
    assert (
        key is not None
        and key.key_id == issued["key_id"]
        and key.allows("qwen3.6-27b")
        and not key.allows("other")
    )
    r = await api.get(f"/admin/v1/tenants/{tid}/keys", params={"consistent": "true"})
    listed = r.json()["items"]
    assert [k["key_id"] for k in listed] == [issued["key_id"]] and "key" not in listed[0]
    conn = await asyncpg.connect(services.database_url)
    try:
        stored = await conn.fetchrow("SELECT * FROM api_keys WHERE key_id = $1", issued["key_id"])
        assert plaintext not in [str(v) for v in stored.values()]
        assert stored["key_hash"] == hashlib.sha256(plaintext.encode()).hexdigest()
    finally:
        await conn.close()

    r = await api.post(f"/admin/v1/tenants/{tid}/keys/{issued['key_id']}/revoke")
    assert r.status_code == 200 and r.json()["status"] == "revoked"
    assert not services.view.key(issued["key_id"]).active  # type: ignore[union-attr]
    _problem(
        await api.post(f"/admin/v1/tenants/{tid}/keys/{issued['key_id']}/revoke"),
        409,
        "key_revoked",
    )
    _problem(
        await api.post(f"/admin/v1/tenants/{tid}/keys", json={"scopes": ["nope"]}),
        422,
        "unknown_sku",
    )
    _problem(await api.post("/admin/v1/tenants/ten_missing/keys", json={}), 404, "tenant_not_found")


async def test_skus_and_price_plans(api: httpx.AsyncClient, services: Services) -> None:
    body = {
        "name": "llama-3.1-8b",
        "model": "meta-llama/Llama-3.1-8B",
        "runtime": "tokenmill",
        "runtime_config": {"dtype": "fp8", "max_batch": 64},
        "gpu_type": "H200",
    }
    r = await api.post("/admin/v1/skus", json=body)
    assert r.status_code == 201, r.text
    sku = r.json()
    assert (
        sku["runtime_config"] == {"dtype": "fp8", "max_batch": 64} and sku["status"] == "published"
    )
    _problem(await api.post("/admin/v1/skus", json=body), 409, "sku_exists")
    assert services.view.sku_by_name("llama-3.1-8b").sku_id == sku["sku_id"]  # type: ignore[union-attr]

    r = await api.post(
        "/admin/v1/skus/llama-3.1-8b/price-plans",
        json={
            "input_per_mtok": "0.10",
            "cached_input_per_mtok": "0.025",
            "output_per_mtok": "0.40",
            "currency": "USD",
            "effective_from": "2026-01-01T00:00:00Z",
        },
    )
    assert r.status_code == 201, r.text
    r = await api.post(
        f"/admin/v1/skus/{sku['sku_id']}/price-plans",
        json={
            "input_per_mtok": "0.08",
            "cached_input_per_mtok": "0.02",
            "output_per_mtok": "0.32",
            "currency": "USD",
            "effective_from": "2026-06-01T00:00:00Z",
        },
    )
    assert r.status_code == 201
    r = await api.get("/admin/v1/skus/llama-3.1-8b/price-plans", params={"consistent": "true"})
    plans = r.json()["items"]
    assert [(p["input_per_mtok"], p["output_per_mtok"]) for p in plans] == [
        ("0.10", "0.40"),
        ("0.08", "0.32"),
    ]

    r = await api.post("/admin/v1/skus/llama-3.1-8b/retire")
    assert r.json()["status"] == "retired"
    r = await api.get("/admin/v1/skus", params={"consistent": "true", "status": "retired"})
    assert [s["name"] for s in r.json()["items"]] == ["llama-3.1-8b"]
    # Republishing a retired name is a new version of the same SKU.
    r = await api.post("/admin/v1/skus", json=body)
    assert (
        r.status_code == 201
        and r.json()["sku_id"] == sku["sku_id"]
        and r.json()["version"] > sku["version"]
    )
    _problem(
        await api.get("/admin/v1/skus/nope", params={"consistent": "true"}), 404, "sku_not_found"
    )


async def test_conflicting_writes_one_wins(api: httpx.AsyncClient) -> None:
    tid = (await api.post("/admin/v1/tenants", json={"name": "acme"})).json()["tenant_id"]
    version = (await api.get(f"/admin/v1/tenants/{tid}", params={"consistent": "true"})).json()[
        "version"
    ]
    # Two admins edit the same version at once: exactly one wins, the other gets a 409.
    a, b = await asyncio.gather(
        api.put(
            f"/admin/v1/tenants/{tid}/labels",
            json={"labels": {"owner": "a"}},
            headers={"If-Match": f'"{version}"'},
        ),
        api.put(
            f"/admin/v1/tenants/{tid}/labels",
            json={"labels": {"owner": "b"}},
            headers={"If-Match": f'"{version}"'},
        ),
    )
    assert sorted([a.status_code, b.status_code]) == [200, 409], (a.text, b.text)
    loser = a if a.status_code == 409 else b
    assert loser.json()["reason"] in {"version_mismatch", "concurrent_write"}
    winner = (a if a.status_code == 200 else b).json()
    r = await api.get(f"/admin/v1/tenants/{tid}", params={"consistent": "true"})
    assert r.json()["labels"] == winner["labels"]
    # Same name published twice at once: one SKU, one 409.
    body = {"name": "dup", "model": "m", "runtime": "tokenmill", "gpu_type": "cpu"}
    rs = await asyncio.gather(*(api.post("/admin/v1/skus", json=body) for _ in range(4)))
    assert sorted(r.status_code for r in rs) == [201, 409, 409, 409]


async def test_bad_requests_are_problem_details(api: httpx.AsyncClient) -> None:
    _problem(
        await api.post("/admin/v1/tenants", json={"name": "x", "colour": "red"}),
        400,
        "unknown_field",
    )
    _problem(await api.post("/admin/v1/tenants", json={"labels": {}}), 400, "invalid_request")
    _problem(await api.post("/admin/v1/tenants", json={"name": ""}), 400, "invalid_request")
    _problem(
        await api.post(
            "/admin/v1/tenants", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
        "invalid_request",
    )
    _problem(await api.post("/admin/v1/tenants", json=["a"]), 400, "invalid_request")
    sku = {"name": "s1", "model": "m", "runtime": "r", "gpu_type": "cpu"}
    assert (await api.post("/admin/v1/skus", json=sku)).status_code == 201
    for bad in (
        {"input_per_mtok": "-1", "cached_input_per_mtok": "0", "output_per_mtok": "1"},
        {"input_per_mtok": 1.5, "cached_input_per_mtok": "0", "output_per_mtok": "1"},
        {
            "input_per_mtok": "1",
            "cached_input_per_mtok": "0",
            "output_per_mtok": "1",
            "currency": "usd",
        },
        {
            "input_per_mtok": "1",
            "cached_input_per_mtok": "0",
            "output_per_mtok": "1",
            "effective_from": "2026-01-01T00:00:00",
        },
    ):
        _problem(await api.post("/admin/v1/skus/s1/price-plans", json=bad), 400, "invalid_request")
    _problem(
        await api.get("/admin/v1/tenants/ten_nope", params={"consistent": "true"}),
        404,
        "tenant_not_found",
    )
    _problem(await api.get("/admin/v1/nothing-here"), 404, "not_found")
    _problem(await api.delete("/admin/v1/tenants"), 405, "method_not_allowed")
    _problem(
        await api.post("/admin/v1/tenants/x/suspend", headers={"If-Match": "abc"}),
        400,
        "invalid_if_match",
    )
    _problem(await api.get("/admin/v1/tenants", params={"limit": "0"}), 400, "invalid_request")
    # No token, a wrong token: 401 with a problem body.
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        body = _problem(await api.get("/admin/v1/tenants", headers=headers), 401, "unauthorized")
        assert body["status"] == 401


async def test_health_and_openapi(api: httpx.AsyncClient) -> None:
    assert (await api.get("/healthz")).json() == {"status": "ok"}
    r = await api.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json()["checks"]["projection_lag"] == {
        "read_models": 0,
        "usage_ledger": 0,
        "invoices": 0,
    }
    spec = (await api.get("/schema/openapi.json")).json()
    assert (
        "/admin/v1/tenants" in spec["paths"] and "/admin/v1/skus/{sku}/price-plans" in spec["paths"]
    )


async def test_an_oversized_admin_body_is_a_413_problem(api: httpx.AsyncClient) -> None:
    # TOKENMILL_MAX_BODY_BYTES, 1 MiB by default: refused before the handler parses it
    big = {"name": "big", "labels": {"blob": "x" * (1024 * 1024)}}
    r = await api.post("/admin/v1/tenants", json=big)
    assert r.status_code == 413, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert (await api.post("/admin/v1/tenants", json={"name": "small"})).status_code == 201
