"""Shared resources of a running control plane, on one explicit object (no globals): the NATS
connection, the event store, the governance view, the Postgres pool and the admin token."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from control_plane.admission.view import GovernanceView
from events.nats_cluster import connect as connect_nats
from events.nats_cluster import ensure_streams
from events.projections import Projector, all_projections, committed_positions, ensure_schema
from events.store import EventStore, StreamLayout
from tokenmill.settings import Settings
from tokenmill.tasks import cancel_and_wait

log = logging.getLogger("tokenmill")


@dataclass
class Services:
    settings: Settings
    nc: NATS
    js: JetStreamContext
    layout: StreamLayout
    store: EventStore
    view: GovernanceView
    pool: asyncpg.Pool
    database_url: str
    admin_token: str
    projectors: list[Projector] = field(default_factory=list)
    # Objects extensions share with each other (see control_plane.app.Extension.extra).
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    async def connect(cls, settings: Settings, admin_token: str) -> Services:
        """Connect to NATS and Postgres (both URLs must be set), create the streams and the
        read-model schema, and replay the control stream into the governance view."""
        if not settings.nats_url or not settings.database_url:
            raise ValueError("Services.connect needs settings.nats_url and settings.database_url")
        nc = await connect_nats(settings.nats_url, name="tokenmill")
        try:
            js = nc.jetstream()
            layout = StreamLayout(prefix=settings.stream_prefix, replicas=settings.stream_replicas)
            store = EventStore(js, layout)
            await ensure_streams(store)
            pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=10)
            assert pool is not None
            async with pool.acquire() as conn:
                await ensure_schema(conn, all_projections())
            view = GovernanceView(js, layout)
            await view.start()
        except BaseException:
            await nc.close()
            raise
        return cls(settings, nc, js, layout, store, view, pool, settings.database_url, admin_token)

    async def close(self) -> None:
        await self.view.stop()
        await self.pool.close()
        await self.nc.drain()

    async def projection_lags(self) -> dict[str, int]:
        """Per projection: stream head minus the committed position (0 = caught up)."""
        positions = await committed_positions(self.pool)
        heads = {self.layout.control_stream: 0, self.layout.usage_stream: 0}
        for stream in heads:
            heads[stream] = await self.store.head(stream)
        return {
            p.name: max(0, heads[p.stream(self.layout)] - positions.get(p.name, 0))
            for p in all_projections()
        }

    async def wait_read_models(self, within: float = 5.0) -> None:
        """Wait until the read models reflect every control event appended so far."""
        head = await self.store.head(self.layout.control_stream)
        deadline = asyncio.get_running_loop().time() + within
        while (await committed_positions(self.pool)).get("read_models", 0) < head:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("read models are behind the control stream")
            await asyncio.sleep(0.01)

    @contextlib.asynccontextmanager
    async def running_projectors(self) -> AsyncIterator[list[Projector]]:
        """Run every projection in this process (as a standby if another process runs it)."""
        self.projectors = [
            Projector(self.nc, self.database_url, self.layout, p) for p in all_projections()
        ]
        tasks = [
            asyncio.create_task(_supervise(p), name=f"projector:{p.projection.name}")
            for p in self.projectors
        ]
        try:
            yield self.projectors
        finally:
            await asyncio.gather(*map(cancel_and_wait, tasks), return_exceptions=True)


async def _supervise(projector: Projector) -> None:
    """Keep a projector running: after a failure (a lost connection, say) it restarts from
    its committed position."""
    while True:
        try:
            await projector.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("projector %s failed; restarting", projector.projection.name)
            await asyncio.sleep(1.0)
