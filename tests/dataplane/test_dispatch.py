"""The dispatch client against protocol peers written here, on real NATS: the failure modes
a real worker rarely shows on demand (no responders, never accepting, going silent)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from control_plane.dataplane import dispatch
from control_plane.dataplane.dispatch import (
    ClientGone,
    NoWorker,
    WorkerClient,
    WorkerLost,
    WorkerRegistry,
)
from control_plane.dataplane.fast_path import nats as fast_nats
from control_plane.dataplane.fast_path.nats import (
    publish_now,
    subscribe_inline,
    write_pending_now,
)
from control_plane.embedded import EmbeddedNats
from worker import protocol as p

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def nc(fast_path: bool, nats_server: EmbeddedNats) -> AsyncIterator[NATS]:
    # Worker clients made on it take the fast path's setting (both, in turn).
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


def scripted_worker(nc: NATS, texts: list[str], go: asyncio.Event) -> object:
    """A worker that, once `go` is set, accepts and sends `texts` as chunks, then Finished."""

    async def answer(msg: Msg) -> None:
        req = p.decode_request(msg.data)
        await go.wait()
        rid = req.request_id
        await nc.publish(req.reply_to, p.encode(p.Accepted(request_id=rid, worker_id="w1")))
        for i, text in enumerate(texts):
            chunk = p.TokenChunk(
                request_id=rid, seq=i, text=text, completion_tokens=i + 1, prompt_tokens=2
            )
            await nc.publish(req.reply_to, p.encode(chunk))
        fin = p.Finished(
            request_id=rid,
            seq=len(texts),
            prompt_tokens=2,
            cached_tokens=0,
            completion_tokens=len(texts),
            finish_reason="stop",
        )
        await nc.publish(req.reply_to, p.encode(fin))

    return answer


class RecordingSink:
    """Takes chunks while `open`; records each with the count the dispatch had then."""

    def __init__(self, d: dispatch.Dispatch, open: bool = True) -> None:
        self.d, self.open = d, open
        self.taken: list[tuple[int, str, int]] = []

    def ready(self) -> bool:
        return self.open

    def take(self, chunk: p.TokenChunk) -> None:
        self.taken.append((chunk.seq, chunk.text, self.d.completion_tokens))


async def scripted(
    nc: NATS, prefix: str, sku_id: str, texts: list[str]
) -> tuple[asyncio.Event, WorkerClient]:
    """A scripted worker serving `sku_id` (it answers once the event is set), and a client."""
    go = asyncio.Event()
    worker = scripted_worker(nc, texts, go)
    await nc.subscribe(p.work_subject(prefix, sku_id), queue="q", cb=worker)  # type: ignore[arg-type]
    return go, await started(nc, prefix)


async def test_a_sink_takes_every_chunk_in_the_read_loop_and_the_consumer_only_the_end(
    nc: NATS, stream_prefix: str
) -> None:
    go, client = await scripted(nc, stream_prefix, "sku_sink", ["a", "", "c"])
    d = await client.dispatch(request("sku_sink"))
    sink = RecordingSink(d)
    d.relay_chunks_to(sink)
    go.set()
    # The consumer is handed nothing: every chunk went to the sink, counted as it was taken
    # (the empty one too: metering follows what the worker sent).
    assert await d.batch() == [] and d.finished is not None
    assert sink.taken == [(0, "a", 1), (1, "", 2), (2, "c", 3)]
    assert d.completion_tokens == 3 and d.gaps == 0 and d.worker_id == "w1"
    await client.close()


async def test_a_sink_that_is_not_ready_or_comes_behind_an_interrupt_leaves_chunks_queued(
    nc: NATS, stream_prefix: str
) -> None:
    go, client = await scripted(nc, stream_prefix, "sku_queued", ["a", "b"])

    # Not ready: the consumer gets the chunks, in order, each once.
    d = await client.dispatch(request("sku_queued"))
    sink = RecordingSink(d, open=False)
    d.relay_chunks_to(sink)
    go.set()
    got = [chunk.text async for chunk in d.chunks()]
    assert got == ["a", "b"] and sink.taken == [] and d.completion_tokens == 2

    # The client hung up before the first chunk: nothing may overtake the interrupt.
    go.clear()
    d = await client.dispatch(request("sku_queued"))
    sink = RecordingSink(d)
    d.relay_chunks_to(sink)
    d.interrupt()
    go.set()
    for _ in range(200):  # the worker's whole answer is in, behind the interrupt
        if len(d._items) == 4:
            break
        await asyncio.sleep(0.01)
    assert sink.taken == []
    with pytest.raises(ClientGone):
        await d.batch()
    d.relay_chunks_to(None)  # as the HTTP layer does once the client is gone
    rest = []
    while d.finished is None:
        rest += [chunk.text for chunk in await d.batch()]
    assert rest == ["a", "b"] and sink.taken == [] and d.completion_tokens == 2
    await client.close()


async def subscribed(conn: NATS) -> None:
    """Returns once the server has `conn`'s subscriptions, so another connection's messages
    reach them. nats-py's flush alone does not promise it: its PING goes straight to the socket,
    ahead of a SUB still in the client's buffer, and the PONG can come back first."""
    write_pending_now(conn)
    await conn.flush()


@pytest.mark.fast_path_only
async def test_publish_now_writes_at_once_but_never_ahead_of_a_pending_publication(
    nc: NATS, nats_server: EmbeddedNats
) -> None:
    other = await nats.connect(nats_server.url)
    sub = await other.subscribe("pn.order")
    await subscribed(other)
    await nc.publish("pn.order", b"queued")  # waits in nats-py's buffer for its flusher
    assert not publish_now(nc, "pn.order", b"late")  # it would overtake that one
    await nc.flush()
    assert publish_now(nc, "pn.order", b"now", reply="pn.reply")
    first, second = await sub.next_msg(timeout=2), await sub.next_msg(timeout=2)
    assert (first.data, second.data, second.reply) == (b"queued", b"now", "pn.reply")
    assert not publish_now(nc, "pn.bad subject", b"x")  # nats-py's own path refuses it
    await other.close()


@pytest.mark.fast_path_only
async def test_inline_replies_arrive_whole_and_in_order_past_other_traffic(
    nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inline subscription's plain messages are read straight from the protocol bytes;
    messages with headers, other subscriptions' messages and frames cut across reads still
    arrive, each once and in order."""
    taken_inline = [0]
    take = fast_nats._InlineParser._take_inline

    def counting(self: Any, buf: bytearray, pos: int) -> tuple[int, int | None]:
        stopped, frame_end = take(self, buf, pos)
        taken_inline[0] += stopped - pos
        return stopped, frame_end

    monkeypatch.setattr(fast_nats._InlineParser, "_take_inline", counting)
    got: list[tuple[str, bytes, dict[str, str] | None]] = []
    others: list[bytes] = []
    await subscribe_inline(nc, "inl.*", lambda s, d, h: got.append((s, d, h)))

    async def other(msg: Msg) -> None:
        others.append(msg.data)

    await nc.subscribe("oth", cb=other)
    await subscribed(nc)
    assert type(nc._ps).__name__ == "_InlineParser"
    sender = await nats.connect(nc.connected_url.geturl())  # type: ignore[union-attr]
    expected: list[tuple[str, bytes, dict[str, str] | None]] = []
    for i in range(300):
        payload = (b"%d-" % i) * (1 + i % 7) + (b"x" * 200_000 if i % 97 == 5 else b"")
        headers = {"K": str(i)} if i % 50 == 3 else None
        await sender.publish(f"inl.{i}", payload, headers=headers)
        expected.append((f"inl.{i}", payload, headers))
        if i % 10 == 0:
            await sender.publish("oth", b"o%d" % i)
    await sender.publish("inl.empty", b"")
    expected.append(("inl.empty", b"", None))
    await sender.flush()
    for _ in range(200):
        if len(got) == len(expected) and len(others) == 30:
            break
        await asyncio.sleep(0.02)
    await sender.close()
    assert [(s, d) for s, d, _ in got] == [(s, d) for s, d, _ in expected]
    assert [h is not None and h.get("K") for _, _, h in got] == [
        h is not None and h["K"] for _, _, h in expected
    ]
    assert others == [b"o%d" % i for i in range(0, 300, 10)]
    assert nc.stats["in_msgs"] >= len(expected) + len(others)
    assert taken_inline[0] > 100_000  # most bytes came the inline way
