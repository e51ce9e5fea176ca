"""Billing on the real servers: the session's NATS (JetStream) and a fresh Postgres database
per test, with the read models of events/ projected by their real projectors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

import asyncpg
import nats
import pytest
from nats.aio.client import Client as NATS

from control_plane.embedded import EmbeddedNats
from events.control import PricePlanSet, SkuPublished, TenantCreated
from events.projections import Projector, all_projections, ensure_schema
from events.projections.runner import Projection
from events.store import EventStore, StreamLayout
from events.usage import GatewayDelivered, RequestFinished
from pricing.jobs import BillingContext, BillingSettings
from pricing.store import BillingStore
from tests.pricing.factories import finished as finished  # the billing tests import it here


@dataclass
class BillingRig:
    nc: NATS
    layout: StreamLayout
    events: EventStore
    pool: asyncpg.Pool
    database_url: str
    store: BillingStore
    ctx: BillingContext

    async def control(self, *events: object) -> None:
        for event in events:
            await self.events.append(event, None)  # type: ignore[arg-type]

    async def usage(self, events: Iterable[RequestFinished | GatewayDelivered]) -> None:
        pending = [self.events.publish_usage(e) for e in events]
        for i in range(0, len(pending), 500):  # bounded concurrency, acks awaited
            await asyncio.gather(*pending[i : i + 500])

    async def project(self, *projections: Projection) -> None:
        """Run projections until they hold every event appended so far."""
        for projection in projections or all_projections():
            head = await self.events.head(projection.stream(self.layout))
            await Projector(self.nc, self.database_url, self.layout, projection).run(until_seq=head)


@pytest.fixture()
async def rig(
    nats_server: EmbeddedNats, database_url: str, stream_prefix: str
) -> AsyncIterator[BillingRig]:
    nc = await nats.connect(nats_server.url)
    layout = StreamLayout(prefix=stream_prefix)
    events = EventStore(nc.jetstream(), layout)
    await events.ensure_streams()
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    assert pool is not None
    async with pool.acquire() as conn:
        await ensure_schema(conn, all_projections())
    store = BillingStore(pool)
    await store.ensure_schema()
    ctx = BillingContext(
        store=store, js=nc.jetstream(), prefix=stream_prefix, settings=BillingSettings(grace_s=3600)
    )
    yield BillingRig(nc, layout, events, pool, database_url, store, ctx)
    await pool.close()
    await nc.drain()


def tenant(tenant_id: str, **labels: str) -> TenantCreated:
    return TenantCreated(tenant_id=tenant_id, name=tenant_id.title(), labels=labels)


def sku(sku_id: str, gpu_type: str = "H200") -> SkuPublished:
    return SkuPublished(
        sku_id=sku_id, name=sku_id, model="qwen3.6-27b", runtime="tokenmill", gpu_type=gpu_type
    )


def price(
    plan_id: str,
    sku_id: str,
    effective_from: datetime,
    output: str,
    input: str = "0.50",
    cached: str = "0.25",
) -> PricePlanSet:
    return PricePlanSet(
        plan_id=plan_id,
        sku_id=sku_id,
        input_per_mtok=input,
        cached_input_per_mtok=cached,
        output_per_mtok=output,
        currency="USD",
        effective_from=effective_from,
    )


def delivered(event: RequestFinished, *, completion: int | None = None) -> GatewayDelivered:
    return GatewayDelivered(
        request_id=event.request_id,
        tenant_id=event.tenant_id,
        key_id=event.key_id,
        sku_id=event.sku_id,
        gateway_id="gw-1",
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens if completion is None else completion,
        finish_reason=event.finish_reason,
        client_disconnected=event.finish_reason == "cancelled",
        finished_at=event.finished_at,
    )


ZERO = Decimal("0.00")
