"""The gateway's usage follower across NATS restarts: a NATS server of the test's own (its
JetStream store on disk, so the streams survive) is really stopped and started again on the
same port, and usage published afterwards must still settle quotas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from control_plane.admission.admit import Admission, Refusal, Ticket
from control_plane.admission.follow import StreamFollower
from control_plane.admission.position import StreamPosition
from control_plane.admission.view import GovernanceView
from control_plane.embedded import EmbeddedNats
from events.store import EventStore, StreamLayout
from events.usage import RequestFinished, usage_stream_name
from tests.admission.conftest import Clock, World, fast_settings

# Real NATS restarts with second-scale waits; on a loaded 2-core machine a restart round once
# outlasted its bounds and the fixture's teardown then hung: run with -m slow.
pytestmark = pytest.mark.slow


@pytest.fixture()
def own_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    server.stop()


async def _connect(server: EmbeddedNats) -> NATS:
    return await nats.connect(
        server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, connect_timeout=1
    )


@pytest.fixture()
async def one_replica(own_nats: EmbeddedNats, stream_prefix: str) -> AsyncIterator[World]:
    nc = await _connect(own_nats)
    layout = StreamLayout(prefix=stream_prefix)
    store = EventStore(nc.jetstream(), layout)
    await store.ensure_streams()
    clock = Clock()
    view = GovernanceView(nc.jetstream(), layout)
    settings = replace(fast_settings(), follower_heartbeat_s=0.3)
    replica = Admission(nc, stream_prefix, view, replica_id="gw0", settings=settings, clock=clock)
    await view.start()
    await replica.start()
    yield World(store, [view], [replica], clock, nc.jetstream())
    await replica.stop()
    await view.stop()
    await nc.close()


def _finished(
    world: World, tenant: str, key: str, sku: str, request_id: str, n: int
) -> RequestFinished:
    return world.usage_event(tenant, key, sku, request_id, 100, n - 100)


async def _publish_until_acked(world: World, event: RequestFinished, within_s: float = 20.0) -> int:
    """The worker's publish: retried while the restarted server is not yet accepting."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            ack = await world.store.publish_usage(event)
            return int(ack.seq)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _until(predicate, within_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_quota_holds_across_nats_restarts(one_replica: World, own_nats: EmbeddedNats) -> None:
    world = one_replica
    replica = world.replicas[0]
    tenant, key, sku = await world.limited("m-restart", token_quota=2000)
    assert replica.ledger.live

    for round_ in range(2):  # the second restart proves the first recovery was not one-shot
        # a request runs; NATS restarts before its usage is published
        ticket = await replica.admit(tenant, key, sku, 100, 900)
        assert isinstance(ticket, Ticket), ticket
        ticket.finish(100, 0, 900)
        own_nats.stop()
        assert await _until(lambda: not replica.ledger.live, 10.0), "outage went unnoticed"
        own_nats.start()
        seq = await _publish_until_acked(
            world, _finished(world, tenant, key, sku, ticket.request_id, 1000)
        )
        # usage published after the restart reaches the follower
        assert await replica.ledger.position.wait_for(seq, 15.0), replica.ledger.follower.status()
        assert replica.ledger.live
        assert replica.ledger.follower.restarts >= round_ + 1
        assert replica.ledger.get(tenant, None, _month(world)).total_tokens == 1000 * (round_ + 1)

    # every reservation has long expired: only the settled sums stand between the tenant and
    # more tokens, and they hold all 2,000 of its quota
    world.clock.now += 31
    await asyncio.sleep(0.3)
    refused = await replica.admit(tenant, key, sku, 100, 100)
    assert isinstance(refused, Refusal) and refused.code == "insufficient_quota", refused
    report = replica.usage_report(tenant, key)
    assert report["policies"][0]["total_tokens"] == 2000  # type: ignore[index]


async def test_reservations_do_not_expire_while_usage_is_unreadable(
    one_replica: World, own_nats: EmbeddedNats
) -> None:
    world = one_replica
    replica = world.replicas[0]
    tenant, key, sku = await world.limited("m-outage", token_quota=1000)
    ticket = await replica.admit(tenant, key, sku, 100, 900)
    assert isinstance(ticket, Ticket)
    ticket.finish(100, 0, 900)
    own_nats.stop()
    try:
        assert await _until(lambda: not replica.ledger.live, 10.0)
        world.clock.now += 31  # past the reservation TTL while nothing can be read
        await asyncio.sleep(0.3)
        assert ticket.request_id in replica._awaiting  # noqa: SLF001
    finally:
        own_nats.start()
    seq = await _publish_until_acked(
        world, _finished(world, tenant, key, sku, ticket.request_id, 1000)
    )
    assert await replica.ledger.position.wait_for(seq, 15.0)
    assert ticket.request_id not in replica._awaiting  # noqa: SLF001 (settled, not expired)
    refused = await replica.admit(tenant, key, sku, 10, 10)
    assert isinstance(refused, Refusal) and refused.code == "insufficient_quota"


async def test_first_consumer_by_time_then_by_sequence(
    nats_server: EmbeddedNats, stream_prefix: str
) -> None:
    """Usage older than the start time is out of scope: the position starts past it (so
    start-up does not wait for it), and only newer messages are applied, each once."""
    nc = await nats.connect(nats_server.url)
    try:
        store = EventStore(nc.jetstream(), StreamLayout(prefix=stream_prefix))
        await store.ensure_streams()
        subject = f"{stream_prefix}.usage.worker.s"
        for i in range(3):
            await nc.jetstream().publish(subject, b"old %d" % i)
        since = datetime.now(UTC)
        await asyncio.sleep(0.05)
        seen: list[bytes] = []
        position = StreamPosition()
        follower = StreamFollower(
            nc,
            usage_stream_name(stream_prefix),
            f"{stream_prefix}.usage.>",
            lambda msg: seen.append(msg.data),
            position,
            heartbeat_s=0.3,
            start_time=lambda: since,
        )
        follower.start()
        try:
            assert await position.wait_for(3, 5.0)
            assert seen == []
            await nc.jetstream().publish(subject, b"new")
            assert await position.wait_for(4, 5.0)
            assert seen == [b"new"]
            assert follower.live
        finally:
            await follower.stop()
        assert not follower.live
    finally:
        await nc.close()


def _month(world: World) -> str:
    from control_plane.admission.windows import quota_window

    return quota_window("month", world.clock.now).label
