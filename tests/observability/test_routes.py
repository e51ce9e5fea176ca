"""The HTTP surface on its own Litestar app: /metrics open unless a metrics token is set, /admin/v1/ops behind the
admin guard, the page under /ui/ with its security headers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from litestar import Litestar, Response
from litestar.testing import AsyncTestClient

from control_plane.auth import admin_guard
from control_plane.observability.metrics import ObservabilitySettings, OpsMetrics
from control_plane.observability.routes import observability_routes
from control_plane.problems import PROBLEM_HANDLERS
from tests.observability.helpers import observe
from worker.protocol import WorkerHeartbeat

TOKEN = "test-admin-token"


@pytest.fixture()
def metrics() -> OpsMetrics:
    return OpsMetrics()


def ops_app(metrics: OpsMetrics) -> Litestar:
    """The observability routes on their own, behind the admin guard with TOKEN."""
    return Litestar(
        route_handlers=observability_routes(metrics, [admin_guard(TOKEN)], with_ledger=False),
        exception_handlers=PROBLEM_HANDLERS,
    )


@pytest.fixture()
async def client(metrics: OpsMetrics) -> AsyncIterator[AsyncTestClient]:
    async with AsyncTestClient(ops_app(metrics)) as c:
        yield c


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_metrics_is_prometheus_text(client: AsyncTestClient, metrics: OpsMetrics) -> None:
    observe(metrics)
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'vllm:generation_tokens_total{model_name="demo",sku="demo"} 2.0' in r.text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in r.text


async def test_ops_endpoints_need_the_admin_token(
    client: AsyncTestClient, metrics: OpsMetrics
) -> None:
    assert (await client.get("/admin/v1/ops/timeseries")).status_code == 401
    assert (
        await client.get("/admin/v1/ops/workers", headers={"Authorization": "Bearer wrong"})
    ).status_code == 401
    metrics.update_worker(
        WorkerHeartbeat(worker_id="w1", sku_id="demo", running=2, waiting=0, kv_pressure=0.5, ts=0)
    )
    workers = (await client.get("/admin/v1/ops/workers", headers=AUTH)).json()["workers"]
    assert [(w["worker_id"], w["running"], w["state"]) for w in workers] == [("w1", 2, "live")]
    ts = (
        await client.get("/admin/v1/ops/timeseries", params={"window_s": 60}, headers=AUTH)
    ).json()
    assert ts["window_s"] == 60 and len(ts["t"]) == 12
    assert ts["skus"]["demo"]["running"][-1] == 2
    assert (
        await client.get("/admin/v1/ops/timeseries", params={"window_s": -1}, headers=AUTH)
    ).status_code == 400


async def test_page_is_served_with_security_headers(client: AsyncTestClient) -> None:
    r = await client.get("/", follow_redirects=False)
    assert r.status_code in (301, 302, 307) and r.headers["location"] == "/ui/"
    page = await client.get("/ui/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "<title>tokenmill · operations</title>" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    module = await client.get("/ui/js/main.js")
    assert module.status_code == 200 and "javascript" in module.headers["content-type"]


async def test_refusals_under_v1_are_counted_by_code_and_worker_failures_are_not() -> None:
    from litestar import post

    from control_plane.dataplane import errors
    from control_plane.observability.feed import RefusalCounter

    @post("/v1/chat/completions/{what:str}")
    async def refuse(what: str) -> None:
        raise {
            "key": errors.invalid_api_key(),
            "worker": errors.worker_failed("boom"),
            "none": errors.no_worker("m"),
        }[what]

    metrics = OpsMetrics()
    app = Litestar(
        route_handlers=[refuse],
        plugins=[RefusalCounter(metrics)],
        exception_handlers={
            errors.OpenAIError: lambda _, e: Response(e.to_json(), status_code=e.status)
        },
    )
    async with AsyncTestClient(app) as c:
        assert (await c.post("/v1/chat/completions/key")).status_code == 401
        assert (await c.post("/v1/chat/completions/key")).status_code == 401
        assert (await c.post("/v1/chat/completions/none")).status_code == 503
        assert (await c.post("/v1/chat/completions/worker")).status_code == 502
    text = metrics.exposition().decode()
    assert 'tokenmill_admissions_refused_total{reason="invalid_api_key",sku=""} 2.0' in text
    assert 'reason="worker_failed"' not in text and 'reason="server_error"' not in text
    assert text.count("tokenmill_admissions_refused_total{") == 2  # invalid_api_key and no-worker


SCRAPE_TOKEN = "scrape-secret"


async def test_metrics_takes_the_metrics_token_when_one_is_set() -> None:
    metrics = OpsMetrics(ObservabilitySettings(metrics_token=SCRAPE_TOKEN))
    metrics.refuse_admission("invalid_api_key")
    async with AsyncTestClient(ops_app(metrics)) as c:
        missing = await c.get("/metrics")
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"].startswith("Bearer")
        assert "tokenmill_" not in missing.text
        assert (
            await c.get("/metrics", headers={"Authorization": "Bearer wrong"})
        ).status_code == 401
        # The admin token is not the scrape token.
        assert (await c.get("/metrics", headers=AUTH)).status_code == 401
        ok = await c.get("/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"})
        assert ok.status_code == 200 and "tokenmill_admissions_refused_total" in ok.text


def test_the_metrics_token_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_METRICS_TOKEN", raising=False)
    assert ObservabilitySettings().metrics_token is None
    monkeypatch.setenv("TOKENMILL_METRICS_TOKEN", SCRAPE_TOKEN)
    assert ObservabilitySettings().metrics_token == SCRAPE_TOKEN
