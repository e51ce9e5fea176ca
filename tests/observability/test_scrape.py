"""What /metrics reads at scrape time in a running control plane, on the real NATS and
Postgres: the projection lag (messages and the age of the oldest unprojected one) and the
open quota reservations of every published SKU."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from control_plane.app import create_app, load_extensions
from control_plane.services import Services
from events.control import SkuPublished, TenantCreated, sku_id_for
from tests.control_plane.conftest import services  # noqa: F401 (a fixture)
from tests.control_plane.serving import served


def scraped(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_projection_lag_and_reservations_are_read_when_scraped(
    services: Services,  # noqa: F811
) -> None:
    sku_id = sku_id_for("demo-sku")
    await services.view.wait_for(
        await services.store.append(
            SkuPublished(sku_id=sku_id, name="demo-sku", model="m/M", runtime="x", gpu_type="cpu"),
            expected_version=0,
        )
    )
    extensions = load_extensions(
        services, ["control_plane.admission", "control_plane.observability"]
    )
    # No projectors run: what is appended stays unprojected, so the lag grows.
    app = create_app(services, extensions=extensions, run_projectors=False)
    async with served(app) as base_url, httpx.AsyncClient(base_url=base_url) as http:
        await services.store.append(TenantCreated(tenant_id="t1", name="t1"), expected_version=0)
        await asyncio.sleep(0.3)
        first = scraped((await http.get("/metrics")).text)
        lag = {"projection": "read_models"}
        assert first[("tokenmill_projection_lag_messages", frozenset(lag.items()))] == 2
        assert first[("tokenmill_projection_lag_seconds", frozenset(lag.items()))] >= 0.3
        caught_up = {"projection": "usage_ledger"}
        assert first[("tokenmill_projection_lag_seconds", frozenset(caught_up.items()))] == 0
        sku = frozenset({("sku", "demo-sku")})
        assert first[("tokenmill_open_reservations", sku)] == 0
        assert first[("tokenmill_reserved_tokens", sku)] == 0
        await asyncio.sleep(0.2)
        later = scraped((await http.get("/metrics")).text)
        assert later[("tokenmill_projection_lag_seconds", frozenset(lag.items()))] >= 0.5


async def test_unresolved_dead_letters_are_read_when_scraped(
    services: Services,  # noqa: F811
) -> None:
    from events.projections import dead_letters

    app = create_app(
        services,
        extensions=load_extensions(services, ["control_plane.observability"]),
        run_projectors=False,
    )
    key = ("tokenmill_projection_dead_letters", frozenset({("projection", "read_models")}))
    async with served(app) as base_url, httpx.AsyncClient(base_url=base_url) as http:
        assert scraped((await http.get("/metrics")).text)[key] == 0
        async with services.pool.acquire() as conn:
            await dead_letters.unresolved_counts(conn)  # creates the table
            recorded = await dead_letters.record(
                conn, "read_models", "TM_CONTROL", 10**9, "x", b"{}", ValueError("bad")
            )
        assert recorded
        try:
            assert scraped((await http.get("/metrics")).text)[key] == 1
        finally:
            async with services.pool.acquire() as conn:
                await conn.execute(
                    "DELETE FROM projection_dead_letters WHERE stream_seq = $1", 10**9
                )
