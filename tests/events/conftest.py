"""A NATS connection and the streams of a fresh prefix, per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS

from control_plane.embedded import EmbeddedNats
from events.store import EventStore, StreamLayout


@pytest.fixture()
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NATS]:
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.close()


@pytest.fixture()
def layout(stream_prefix: str) -> StreamLayout:
    return StreamLayout(prefix=stream_prefix)


@pytest.fixture()
async def store(nc: NATS, layout: StreamLayout) -> EventStore:
    s = EventStore(nc.jetstream(), layout)
    await s.ensure_streams()
    return s
