"""The streams of a fresh prefix, per test, on the NATS connection of tests/conftest.py."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS

from events.store import EventStore, StreamLayout


@pytest.fixture()
def layout(stream_prefix: str) -> StreamLayout:
    return StreamLayout(prefix=stream_prefix)


@pytest.fixture()
async def store(nc: NATS, layout: StreamLayout) -> EventStore:
    s = EventStore(nc.jetstream(), layout)
    await s.ensure_streams()
    return s
