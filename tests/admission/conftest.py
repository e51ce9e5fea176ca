"""A governed world on the real NATS fixture: streams, the backbone's view, and helpers that
append control events and usage events the way the admin API and the workers do."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import nats
import pytest

from control_plane.admission.admit import Admission
from control_plane.admission.view import GovernanceView
from control_plane.embedded import EmbeddedNats
from events import control
from events.control import LimitsSet
from events.store import EventStore, StreamLayout
from events.usage import RequestFinished
from tokenmill.settings import AdmissionSettings

# Mid-window of a fixed minute, so a test never straddles a rate window or a quota period.
T0 = 1_899_999_960.0 + 30.0  # 1_899_999_960 is a whole minute
_ids = itertools.count()


@dataclass
class Clock:
    now: float = T0

    def __call__(self) -> float:
        return self.now


@dataclass
class World:
    store: EventStore
    views: list[GovernanceView]
    replicas: list[Admission]
    clock: Clock
    js: object
    keys: dict[str, str] = field(default_factory=dict)  # key_id -> tenant_id

    async def append(self, event: control.AnyControlEvent) -> None:
        seq = await self.store.append(event, None)
        for view in self.views:
            await view.wait_for(seq, 5.0)
        for replica in self.replicas:
            if isinstance(event, LimitsSet):
                await replica.limits.position.wait_for(seq, 5.0)

    async def limited(self, sku_name: str, **limits: Any) -> tuple[str, str, str]:
        """A new tenant with one key, the SKU `sku_name`, and the tenant's `limits` in force."""
        tenant = await self.tenant()
        key = await self.key(tenant)
        sku = await self.sku(sku_name)
        await self.append(LimitsSet(tenant_id=tenant, **limits))
        return tenant, key, sku

    async def tenant(self) -> str:
        tenant_id = f"ten_{next(_ids)}"
        await self.append(control.TenantCreated(tenant_id=tenant_id, name=tenant_id))
        return tenant_id

    async def key(self, tenant_id: str, scopes: list[str] | None = None) -> str:
        key_id = f"key_{next(_ids)}"
        await self.append(
            control.ApiKeyIssued(
                key_id=key_id,
                tenant_id=tenant_id,
                key_hash=key_id,
                prefix="tm-",
                scopes=scopes or [],
            )
        )
        self.keys[key_id] = tenant_id
        return key_id

    async def sku(self, name: str, price: tuple[str, str, str] | None = None) -> str:
        sku_id = control.sku_id_for(name)
        await self.append(
            control.SkuPublished(
                sku_id=sku_id, name=name, model=name, runtime="test", gpu_type="cpu"
            )
        )
        if price:
            await self.price(sku_id, price)
        return sku_id

    async def price(self, sku_id: str, price: tuple[str, str, str]) -> None:
        await self.append(
            control.PricePlanSet(
                plan_id=f"plan_{next(_ids)}",
                sku_id=sku_id,
                input_per_mtok=price[0],
                cached_input_per_mtok=price[1],
                output_per_mtok=price[2],
                currency="USD",
                effective_from=datetime.fromtimestamp(self.clock.now - 1, UTC),
            )
        )

    def usage_event(
        self,
        tenant_id: str,
        key_id: str,
        sku_id: str,
        request_id: str,
        prompt: int,
        completion: int,
    ) -> RequestFinished:
        """A worker's usage event for the request, finished now on the world's clock."""
        at = datetime.fromtimestamp(self.clock.now, UTC)
        return RequestFinished(
            request_id=request_id,
            tenant_id=tenant_id,
            key_id=key_id,
            sku_id=sku_id,
            model="m",
            worker_id="w",
            prompt_tokens=prompt,
            completion_tokens=completion,
            finish_reason="stop",
            e2e_ms=1.0,
            started_at=at,
            finished_at=at,
        )

    async def finished(self, *usage: Any) -> None:
        """The worker's usage event (`usage_event`'s arguments); returns once every replica
        has read it."""
        ack = await self.store.publish_usage(self.usage_event(*usage))
        for replica in self.replicas:
            assert await replica.ledger.position.wait_for(ack.seq, 5.0)


def fast_settings() -> AdmissionSettings:
    return AdmissionSettings(
        default_max_tokens=256,
        reservation_ttl_s=30.0,
        stream_slot_ttl_s=10.0,
        sync_interval_s=0.05,
        idle_return_s=0.2,
        lease_fraction=0.02,
    )


@pytest.fixture()
async def world(nats_server: EmbeddedNats, stream_prefix: str) -> AsyncIterator[World]:
    """Two admission replicas (each with its own NATS connection and governance view)."""
    conns = [await nats.connect(nats_server.url) for _ in range(2)]
    layout = StreamLayout(prefix=stream_prefix)
    store = EventStore(conns[0].jetstream(), layout)
    await store.ensure_streams()
    clock = Clock()
    views = [GovernanceView(nc.jetstream(), layout) for nc in conns]
    replicas = [
        Admission(
            nc,
            stream_prefix,
            view,
            replica_id=f"gw{i}",
            settings=fast_settings(),
            clock=clock,
        )
        for i, (nc, view) in enumerate(zip(conns, views, strict=True))
    ]
    for view, replica in zip(views, replicas, strict=True):
        await view.start()
        await replica.start()
    yield World(store, views, replicas, clock, conns[0].jetstream())
    for view, replica in zip(views, replicas, strict=True):
        await replica.stop()
        await view.stop()
    for nc in conns:
        await nc.close()
