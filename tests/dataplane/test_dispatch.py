"""The dispatch client against protocol peers written here, on real NATS: the failure modes
a real worker rarely shows on demand (no responders, never accepting, going silent)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from control_plane.dataplane.dispatch import NoWorker, WorkerClient, WorkerLost, WorkerRegistry
from control_plane.embedded import EmbeddedNats
from worker import protocol as p

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NATS]:
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.close()


def request(sku: str) -> p.GenerateRequest:
    return p.GenerateRequest(
        request_id=f"r{time.monotonic_ns()}",
        tenant_id="t",
        key_id="k",
        sku_id=sku,
        model="m",
        prompt="hi",
        reply_to="",
        admitted_at=time.time(),
    )


async def started(nc: NATS, prefix: str, **timeouts: float) -> WorkerClient:
    registry = WorkerRegistry(nc, prefix, dead_after_s=1.0)
    await registry.start()
    client = WorkerClient(nc, prefix, registry, **timeouts)
    await client.start()
    return client


async def test_no_worker_in_the_queue_group_is_no_worker(nc: NATS, stream_prefix: str) -> None:
    client = await started(nc, stream_prefix)
    d = await client.dispatch(request("sku_none"))
    with pytest.raises(NoWorker):
        async for _ in d.chunks():
            pass
    await client.close()


async def test_a_request_nobody_accepts_fails_after_the_accept_timeout(
    nc: NATS, stream_prefix: str
) -> None:
    async def swallow(msg: Msg) -> None:  # takes the request, never answers
        return None

    await nc.subscribe(p.work_subject(stream_prefix, "sku_mute"), queue="q", cb=swallow)
    client = await started(nc, stream_prefix, accept_timeout_s=0.5)
    t0 = time.monotonic()
    d = await client.dispatch(request("sku_mute"))
    with pytest.raises(WorkerLost):
        async for _ in d.chunks():
            pass
    assert 0.4 < time.monotonic() - t0 < 3
    await client.close()


async def test_a_live_worker_gone_silent_on_a_request_fails_it(
    nc: NATS, stream_prefix: str
) -> None:
    """It accepts and keeps heartbeating, but its replies for this request never come."""

    async def accept_then_nothing(msg: Msg) -> None:
        req = p.decode_request(msg.data)
        await nc.publish(
            req.reply_to, p.encode(p.Accepted(request_id=req.request_id, worker_id="w1"))
        )
        await nc.publish(
            req.reply_to,
            p.encode(
                p.TokenChunk(
                    request_id=req.request_id, seq=0, text="a", completion_tokens=1, prompt_tokens=1
                )
            ),
        )

    async def heartbeat() -> None:
        while True:
            beat = p.WorkerHeartbeat(
                worker_id="w1",
                sku_id="sku_quiet",
                running=1,
                waiting=0,
                kv_pressure=0.0,
                ts=time.time(),
            )
            await nc.publish(p.heartbeat_subject(stream_prefix, "sku_quiet"), p.encode(beat))
            await asyncio.sleep(0.1)

    beating = asyncio.create_task(heartbeat())
    await nc.subscribe(
        p.work_subject(stream_prefix, "sku_quiet"), queue="q", cb=accept_then_nothing
    )
    client = await started(nc, stream_prefix, silence_timeout_s=0.6)
    d = await client.dispatch(request("sku_quiet"))
    got = []
    with pytest.raises(WorkerLost):
        async for chunk in d.chunks():
            got.append(chunk.text)
    assert got == ["a"] and d.completion_tokens == 1 and d.worker_id == "w1"
    beating.cancel()
    await client.close()
