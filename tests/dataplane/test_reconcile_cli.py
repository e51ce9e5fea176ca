"""`tokenmill reconcile` over a real ledger: all match, then a delivery nobody billed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from events.usage import GatewayDelivered, dedupe_id, encode_usage, usage_subject
from tests.dataplane.harness import ROOT, Stack
from tests.dataplane.test_openai_api import tenant_client

# Not among the contract tests run both ways (tests/dataplane/conftest.py): the default only.
pytestmark = [pytest.mark.timeout(120), pytest.mark.fast_path_only]


async def reconcile_cli(stack: Stack) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TOKENMILL_NATS_URL": stack.nats_url,
        "TOKENMILL_DATABASE_URL": stack.services.database_url,
        "TOKENMILL_STREAM_PREFIX": stack.prefix,
    }
    cmd = [sys.executable, "-m", "tokenmill.cli", "reconcile", "--grace-s", "0"]
    return await asyncio.to_thread(
        subprocess.run, cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


async def test_reconcile_reports_the_match_rate_and_every_mismatch(
    stack: Stack, sku: dict[str, Any]
) -> None:
    client = await tenant_client(stack)
    answers = await asyncio.gather(
        *(client.completions.create(model=sku["name"], prompt="p", max_tokens=3) for _ in range(5))
    )
    ids = [a.id.removeprefix("cmpl-") for a in answers]
    await stack.ledger_rows(ids)
    await stack.delivery_rows(ids)
    ok = await reconcile_cli(stack)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "requests 5, matched 5, mismatched 0" in ok.stdout and "match rate 100.00%" in ok.stdout

    # A delivery no worker billed (as if a usage event were lost): reported, exit status 1.
    ghost = GatewayDelivered(
        request_id=uuid.uuid4().hex,
        tenant_id="ten_x",
        key_id="key_x",
        sku_id=sku["sku_id"],
        gateway_id="gw-test",
        prompt_tokens=1,
        completion_tokens=2,
        finish_reason="stop",
        finished_at=datetime.now(UTC),
    )
    await stack.services.js.publish(
        usage_subject(stack.prefix, "gateway", sku["sku_id"]),
        encode_usage(ghost),
        headers={"Nats-Msg-Id": dedupe_id(ghost)},
    )
    await stack.delivery_rows([ghost.request_id])
    bad = await reconcile_cli(stack)
    assert bad.returncode == 1
    assert "match rate 83.33%" in bad.stdout
    assert f"MISMATCH {ghost.request_id}" in bad.stdout and "not in the usage ledger" in bad.stdout
