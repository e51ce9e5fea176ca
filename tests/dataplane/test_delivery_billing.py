"""Billing follows delivery: the bill is what reached the client, the worker's record is what it
generated, and the difference is recorded as unbilled waste; reconciliation ties the three."""

from __future__ import annotations

import asyncio
import gc
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import nats
import openai
import pytest

from control_plane.embedded import EmbeddedNats
from events.store import StreamLayout
from events.usage import (
    RequestFinished,
    WorkerGenerated,
    decode_usage,
    dedupe_id,
    encode_usage,
    usage_subject,
)
from pricing.reconcile import reconcile
from tests.dataplane.harness import Stack, read_killing_the_worker, read_then_hang_up
from tests.dataplane.test_openai_api import MESSAGES, async_client, expected_text, tenant_client
from worker import protocol as p
from worker.backends import make_backend
from worker.serve import Worker, WorkerSettings

pytestmark = pytest.mark.timeout(90)


async def generation_rows(
    stack: Stack, request_ids: list[str], within: float = 10.0
) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + within
    while True:
        rows = await stack.services.pool.fetch(
            "SELECT * FROM worker_generations WHERE request_id = ANY($1)", request_ids
        )
        if len(rows) == len(set(request_ids)) or time.monotonic() > deadline:
            return {r["request_id"]: dict(r) for r in rows}
        await asyncio.sleep(0.05)


async def records(stack: Stack, request_id: str) -> tuple[dict[str, Any], ...]:
    billed = await stack.ledger_row(request_id)
    delivered = (await stack.delivery_rows([request_id]))[request_id]
    generated = (await generation_rows(stack, [request_id])).get(request_id)
    return billed, delivered, generated  # type: ignore[return-value]


async def test_a_hang_up_bills_what_was_delivered_and_records_the_rest_as_waste(
    stack: Stack,
) -> None:
    # Fast enough that tokens are generated between the hang-up and the worker's cancel.
    sku, _ = await stack.served_sku("fast-", tokens_per_s=2000, output_tokens=5000)
    _, key = await stack.tenant_with_key()
    stream = await async_client(stack, key["key"]).chat.completions.create(
        model=sku["name"], messages=MESSAGES, stream=True
    )
    received = 0
    request_id = ""
    async for chunk in stream:
        request_id = chunk.id.removeprefix("chatcmpl-")
        received += 1
        if received == 50:
            # Stop reading for a while: the gateway keeps writing into the socket buffers.
            await asyncio.sleep(0.3)
            break
    await stream.close()
    billed, delivered, generated = await records(stack, request_id)
    assert generated is not None and generated["finish_reason"] == "cancelled"
    assert billed["finish_reason"] == "cancelled" and delivered["client_disconnected"]
    # What was billed is exactly what the gateway wrote to the client, at least what it read.
    assert billed["completion_tokens"] == delivered["completion_tokens"] >= received
    assert billed["prompt_tokens"] == delivered["prompt_tokens"] > 0
    # The rest of what the worker generated is waste, and it stopped well short of 5000.
    assert (
        billed["unbilled_waste_tokens"]
        == generated["completion_tokens"] - billed["completion_tokens"]
    )
    assert billed["completion_tokens"] < generated["completion_tokens"] < 5000
    # And counted on /metrics, for the tenant.
    metrics = stack.services.extra["metrics"]
    waste = metrics.registry.get_sample_value(
        "tokenmill_unbilled_waste_tokens_total", {"tenant": billed["tenant_id"], "sku": sku["name"]}
    )
    assert waste == billed["unbilled_waste_tokens"]


async def test_a_worker_dying_mid_stream_bills_the_delivered_tokens(stack: Stack) -> None:
    sku, worker = await stack.served_sku("dying-", tokens_per_s=20, output_tokens=100)
    _, key = await stack.tenant_with_key()
    streamed = await async_client(stack, key["key"]).chat.completions.create(
        model=sku["name"], messages=MESSAGES, stream=True
    )
    received, request_id, error = await read_killing_the_worker(streamed, worker, after=4)
    assert "worker" in str(error.message)
    assert "".join(received) == expected_text(len(received))
    billed, delivered, generated = await records(stack, request_id)
    assert generated is None  # killed: it never said what it generated
    assert (billed["completion_tokens"], billed["finish_reason"]) == (len(received), "error")
    assert delivered["completion_tokens"] == len(received) and delivered["worker_lost"]
    assert billed["unbilled_waste_tokens"] == 0 and billed["prompt_tokens"] > 0


# The default only (12 s, mostly waiting for the kill to be noticed): nothing is written to
# the client before the 502, so neither path's writes are involved.
@pytest.mark.fast_path_only
async def test_a_502_before_any_token_bills_nothing(stack: Stack) -> None:
    # A non-streamed answer is delivered whole or not at all: tokens arrive at the gateway,
    # then the worker dies before the body is written.
    sku, worker = await stack.served_sku("late-", tokens_per_s=20, output_tokens=100)
    client = await tenant_client(stack)
    whole = asyncio.create_task(
        client.with_options(max_retries=0).chat.completions.create(
            model=sku["name"], messages=MESSAGES
        )
    )
    await asyncio.sleep(0.6)
    worker.send_signal(signal.SIGKILL)
    with pytest.raises(openai.InternalServerError) as e:
        await whole
    assert e.value.status_code == 502
    request_id = e.value.response.headers["x-request-id"]
    billed, delivered, _ = await records(stack, request_id)
    assert (billed["prompt_tokens"], billed["cached_tokens"], billed["completion_tokens"]) == (
        0,
        0,
        0,
    )
    assert delivered["completion_tokens"] == 0 and delivered["prompt_tokens"] == 0
    # What the gateway had received (about 0.6 s at 20 tokens/s) is waste.
    assert billed["unbilled_waste_tokens"] >= 5


async def test_reconciliation_ties_generated_delivered_and_billed(
    stack: Stack, sku: dict[str, Any]
) -> None:
    since = datetime.now(UTC)
    client = await tenant_client(stack)

    async def hang_up_after(n: int) -> str:
        stream = await client.chat.completions.create(
            model=sku["name"], messages=MESSAGES, stream=True
        )
        return await read_then_hang_up(stream, n)

    ids = await asyncio.gather(*(hang_up_after(n) for n in (2, 5, 40, 40)))
    await stack.ledger_rows(ids)
    await stack.delivery_rows(ids)
    await generation_rows(stack, ids)
    report = await reconcile(stack.services.pool, since=since)
    assert report.mismatches == [], report.lines()
    assert (
        report.generated_completion_tokens
        == report.delivered_completion_tokens + report.unbilled_waste_tokens
    )
    assert report.billed_completion_tokens == report.delivered_completion_tokens


async def test_the_worker_finishes_before_its_record_is_acked_and_retries_it(
    nats_server: EmbeddedNats,
) -> None:
    # A prefix with no usage stream yet: every publish of the worker's record fails (no
    # responders) until the stream is made, as when JetStream is down or an ack is lost.
    prefix = "W" + uuid.uuid4().hex[:10].upper()
    settings = WorkerSettings(
        nats_url=nats_server.url, stream_prefix=prefix, sku_id="s1", model="m", heartbeat_s=0.1
    )
    worker = Worker(
        settings, make_backend("fixed_rate", {"tokens_per_s": 1000, "output_tokens": 3})
    )
    nc = await nats.connect(nats_server.url)
    serving = asyncio.create_task(worker.run())
    try:
        beats = await nc.subscribe(p.heartbeat_subject(prefix, "s1"))
        await beats.next_msg(timeout=10)  # serving
        # what the process held when it started serving is out of the collector's sight
        assert gc.get_freeze_count() > 0
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        request = p.GenerateRequest(
            request_id=uuid.uuid4().hex, tenant_id="t", key_id="k", sku_id="s1", model="m",
            prompt="go", reply_to=inbox, admitted_at=time.time(),
        )  # fmt: skip
        await nc.publish(p.work_subject(prefix, "s1"), p.encode(request))
        finished = None
        while finished is None:
            reply = p.decode_reply((await replies.next_msg(timeout=5)).data)
            if isinstance(reply, p.Finished):
                finished = reply
        assert (finished.completion_tokens, finished.finish_reason) == (3, "stop")
        # Finished came although the record could not be stored; it is still being retried.
        assert any(not t.done() for t in worker._handlers)
        js = nc.jetstream()
        await js.add_stream(StreamLayout(prefix=prefix).usage_config())
        sub = await js.subscribe(f"{prefix}.usage.>", ordered_consumer=True)
        event = decode_usage((await sub.next_msg(timeout=10)).data)
        assert isinstance(event, WorkerGenerated) and event.request_id == request.request_id
        assert event.completion_tokens == 3
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 30)
        await nc.close()
    assert gc.get_freeze_count() == 0  # given back when it stops


async def test_reconciliation_waits_a_grace_period_before_calling_a_mismatch(
    stack: Stack, sku: dict[str, Any]
) -> None:
    # A bill whose delivery report has not arrived (yet).
    now = datetime.now(UTC)
    common: dict[str, Any] = {
        "request_id": uuid.uuid4().hex, "tenant_id": "ten_g", "key_id": "key_g",
        "sku_id": sku["sku_id"], "prompt_tokens": 3, "completion_tokens": 4,
        "finish_reason": "stop", "finished_at": now,
    }  # fmt: skip
    bill = RequestFinished(
        **common, model="m", worker_id="w", e2e_ms=1.0, started_at=now - timedelta(seconds=1)
    )
    generated = WorkerGenerated(
        **common, model="m", worker_id="w", e2e_ms=1.0, started_at=now - timedelta(seconds=1)
    )
    for kind, event in (("worker", bill), ("worker", generated)):
        await stack.services.js.publish(
            usage_subject(stack.prefix, kind, sku["sku_id"]),  # type: ignore[arg-type]
            encode_usage(event),
            headers={"Nats-Msg-Id": dedupe_id(event)},
        )
    rid = bill.request_id
    await stack.ledger_rows([rid])
    assert await generation_rows(stack, [rid])
    report = await reconcile(stack.services.pool, since=now - timedelta(seconds=1))
    assert report.pending == 1 and report.mismatches == []
    report = await reconcile(
        stack.services.pool, since=now - timedelta(seconds=1), grace=timedelta(0)
    )
    assert [(m.request_id, m.problem) for m in report.mismatches] == [
        (rid, "billed but no gateway delivery recorded")
    ]
