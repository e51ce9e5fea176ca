"""Exactly-once metering when things go wrong: clients that hang up mid-stream and workers
that die mid-stream, checked token by token against the ledger; then reconciliation."""

from __future__ import annotations

import asyncio
import random
import signal
from typing import Any

import openai
import pytest

from pricing.reconcile import reconcile
from tests.dataplane.harness import DEAD_AFTER_S, Stack, read_killing_the_worker
from tests.dataplane.test_delivery_billing import generation_rows
from tests.dataplane.test_openai_api import (
    MESSAGES,
    async_client,
    expected_text,
    sync_client,
    tenant_client,
)

pytestmark = pytest.mark.timeout(120)

SLOW_RATE = 20.0  # tokens/s: a 100-token answer takes 5 s, so a hang-up always lands mid-stream


@pytest.fixture(scope="module")
async def slow_sku(stack: Stack) -> dict[str, Any]:
    sku, _ = await stack.served_sku("slow-", tokens_per_s=SLOW_RATE, output_tokens=100)
    return sku


async def test_a_client_hanging_up_cancels_and_is_metered_to_the_token(
    stack: Stack, slow_sku: dict[str, Any]
) -> None:
    _, key = await stack.tenant_with_key()
    stream = await async_client(stack, key["key"]).chat.completions.create(
        model=slow_sku["name"], messages=MESSAGES, stream=True
    )
    received = []
    async for chunk in stream:
        received.append(chunk.choices[0].delta.content or "")
        if len(received) == 3:
            break
    await stream.close()
    request_id = chunk.id.removeprefix("chatcmpl-")
    row = await stack.ledger_row(request_id)
    delivered = (await stack.delivery_rows([request_id]))[request_id]
    assert "".join(received) == expected_text(3)
    assert row["finish_reason"] == "cancelled"
    # Generation stopped soon after the hang-up (not at 100 tokens), and what the worker billed
    # is exactly what the gateway received from it, including tokens in flight at the hang-up.
    assert 3 <= row["completion_tokens"] < 20
    assert (
        delivered["completion_tokens"] == row["completion_tokens"]
        and delivered["client_disconnected"]
    )
    assert delivered["finish_reason"] == "cancelled"


async def test_a_sync_client_leaving_the_stream_early_cancels_it(
    stack: Stack, slow_sku: dict[str, Any]
) -> None:
    _, key = await stack.tenant_with_key()
    client = sync_client(stack, key["key"])

    def read_two() -> str:
        with client.completions.create(
            model=slow_sku["name"], prompt="go", max_tokens=90, stream=True
        ) as stream:
            for i, chunk in enumerate(stream):
                if i == 1:
                    return chunk.id
        raise AssertionError("stream ended early")

    request_id = (await asyncio.to_thread(read_two)).removeprefix("cmpl-")
    row = await stack.ledger_row(request_id)
    assert row["finish_reason"] == "cancelled" and 2 <= row["completion_tokens"] < 20


async def test_a_worker_killed_mid_stream_gives_an_error_and_its_tokens_are_metered(
    stack: Stack,
) -> None:
    sku, worker = await stack.served_sku("doomed-", tokens_per_s=SLOW_RATE, output_tokens=100)
    client = await tenant_client(stack)
    streamed = await client.chat.completions.create(
        model=sku["name"], messages=MESSAGES, stream=True
    )
    # A second, non-streamed request on the same worker dies with it.
    whole = asyncio.create_task(
        client.chat.completions.create(model=sku["name"], messages=MESSAGES)
    )
    received, request_id, error = await read_killing_the_worker(streamed, worker, after=5)
    assert "worker" in str(error.message)
    with pytest.raises(openai.InternalServerError) as e2:
        await whole
    assert e2.value.status_code == 502 and e2.value.code == "worker_error"

    text = "".join(received)
    n = len(received)
    assert text == expected_text(n) and n >= 5
    row = await stack.ledger_row(request_id)
    assert row["finish_reason"] == "error" and row["completion_tokens"] == n and row["worker_id"]
    assert row["prompt_tokens"] > 0
    delivered = (await stack.delivery_rows([request_id]))[request_id]
    assert (delivered["completion_tokens"], delivered["finish_reason"]) == (n, "error")
    # The client heard about it within about the heartbeat timeout.
    assert row["e2e_ms"] < (n / SLOW_RATE + DEAD_AFTER_S + 2) * 1000


async def test_a_worker_stopped_cleanly_finishes_its_requests_first(stack: Stack) -> None:
    sku, worker = await stack.served_sku("draining-", tokens_per_s=50, output_tokens=20)
    client = await tenant_client(stack)
    stream = await client.chat.completions.create(model=sku["name"], messages=MESSAGES, stream=True)
    first = await anext(aiter(stream))
    worker.send_signal(signal.SIGTERM)
    rest = [c async for c in stream]
    text = (first.choices[0].delta.content or "") + "".join(
        c.choices[0].delta.content or "" for c in rest if c.choices
    )
    assert text == expected_text(20)
    row = await stack.ledger_row(first.id.removeprefix("chatcmpl-"))
    assert (row["completion_tokens"], row["finish_reason"]) == (20, "stop")
    await asyncio.to_thread(worker.wait, 10)
    # Gone means gone: the next request gets a 503 at once, not a timeout.
    with pytest.raises(openai.InternalServerError) as e:
        await client.chat.completions.create(model=sku["name"], messages=MESSAGES)
    assert e.value.status_code == 503


async def test_concurrent_streams_with_hang_ups_reconcile_exactly(
    stack: Stack, sku: dict[str, Any]
) -> None:
    client = await tenant_client(stack)
    rng = random.Random(5)

    async def one(i: int) -> tuple[str, int, bool]:
        hang_up_after = rng.choice([None, None, None, 2, 6])
        stream = await client.chat.completions.create(
            model=sku["name"], messages=MESSAGES, stream=True, max_tokens=rng.randint(8, 32)
        )
        got = 0
        async for chunk in stream:
            if not (chunk.choices and chunk.choices[0].delta.content):
                continue  # the closing chunk (finish reason, no text)
            got += 1
            if got == hang_up_after:
                await stream.close()
                break
        return chunk.id.removeprefix("chatcmpl-"), got, hang_up_after is not None

    results = await asyncio.gather(*(one(i) for i in range(40)))
    ids = [r[0] for r in results]
    ledger = await stack.ledger_rows(ids)
    await stack.delivery_rows(ids)
    await generation_rows(stack, ids)  # each worker record too: reconcile compares all three
    for request_id, got, hung_up in results:
        assert ledger[request_id]["completion_tokens"] >= got
        if not hung_up:
            assert ledger[request_id]["completion_tokens"] == got
    report = await reconcile(stack.services.pool)
    assert report.mismatches == [] and report.pending == 0
    assert report.match_rate == 1.0 and report.requests >= 40
