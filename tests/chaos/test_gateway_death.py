"""A gateway that goes silent mid-stream (its NATS connection closes, as when its process
dies): the worker stops generating within the lease bound, records what it generated as
waste, and nothing is billed beyond what was delivered (here: nothing, no gateway billed);
reconciliation classifies it as gateway lost."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest

from pricing.reconcile import reconcile
from tests.dataplane.harness import Stack
from tests.dataplane.test_delivery_billing import generation_rows
from tests.dataplane.test_openai_api import MESSAGES, async_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SILENT_S = 1.5  # the worker's bound on a silent gateway, shortened for the test
RATE = 50.0  # tokens/s: 2,000 tokens would take 40 s


async def test_a_dead_gateways_requests_stop_on_the_worker(stack: Stack) -> None:
    sku = await stack.publish_sku("orphan-" + uuid.uuid4().hex[:6])
    stack.start_worker(
        sku["sku_id"],
        tokens_per_s=RATE,
        output_tokens=2000,
        env={"TOKENMILL_WORKER_GATEWAY_SILENT_S": str(SILENT_S)},
    )
    await stack.wait_served(sku["sku_id"])
    _, key = await stack.tenant_with_key()
    stream = await async_client(stack, key["key"]).chat.completions.create(
        model=sku["name"], messages=MESSAGES, stream=True
    )
    received, request_id = 0, ""
    async for chunk in stream:
        received, request_id = received + 1, chunk.id.removeprefix("chatcmpl-")
        if received == 10:
            break
    # The gateway drops off NATS: no more lease, no bill, no delivery report from it.
    assert stack.plane.nc is not None
    silenced = time.monotonic()
    await stack.plane.nc.close()
    rows = await generation_rows(stack, [request_id], within=SILENT_S + 10)
    stopped_within = time.monotonic() - silenced
    await stream.close()
    assert request_id in rows, "the worker never stopped"
    row = rows[request_id]
    assert row["gateway_lost"] and row["finish_reason"] == "cancelled"
    # Stopped within the bound (plus a lease period and the record's way to Postgres), long
    # before the 2,000 tokens: everything past what the client read is waste.
    assert stopped_within < SILENT_S + 3
    assert received <= row["completion_tokens"] < received + (SILENT_S + 3) * RATE
    billed = await stack.services.pool.fetchval(
        "SELECT count(*) FROM usage_ledger WHERE request_id = $1", request_id
    )
    assert billed == 0
    # Reconciliation lists it as gateway lost (not a mismatch): generated, neither delivered
    # nor billed, its tokens counted as waste.
    report = await reconcile(stack.services.pool, grace=timedelta(0))
    assert request_id not in [m.request_id for m in report.mismatches]
    (lost,) = [g for g in report.gateway_lost if g.request_id == request_id]
    assert lost.lease_stopped and lost.gateway_id == stack.plane.gateway.gateway_id
    assert lost.generated_completion_tokens == row["completion_tokens"]
    assert report.unbilled_waste_tokens >= row["completion_tokens"]
