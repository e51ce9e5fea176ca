"""/readyz says whether this replica can serve, within 250 ms whatever its backends do."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from control_plane.embedded import EmbeddedNats, EmbeddedPostgres
from tests.databases import fresh_database
from tests.dataplane.harness import Stack, running_stack

pytestmark = pytest.mark.timeout(90)

WITHIN_S = 0.25


async def probe(stack: Stack) -> tuple[httpx.Response, float]:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=5) as http:
        t0 = time.monotonic()
        r = await http.get("/readyz")
        return r, time.monotonic() - t0


async def until_status(stack: Stack, status: int, within: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        r, took = await probe(stack)
        assert took < WITHIN_S, f"/readyz took {took:.3f} s"
        if r.status_code == status:
            return r.json()  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, r.text
        await asyncio.sleep(0.1)


async def test_ready_lists_unserved_skus_without_being_unready(
    stack: Stack, sku: dict[str, Any]
) -> None:
    idle = await stack.publish_sku("idle-" + uuid.uuid4().hex[:6])
    body = await until_status(stack, 200)
    checks = body["checks"]
    assert checks["nats"] and checks["postgres"] and checks["usage_follower"]
    assert idle["name"] in checks["unserved_skus"]
    assert sku["name"] not in checks["unserved_skus"]


async def test_a_hung_postgres_is_answered_within_the_bound(
    stack: Stack, sku: dict[str, Any]
) -> None:
    await until_status(stack, 200)
    async with stack.services.pool.acquire() as conn, conn.transaction():
        # Every read of the dead letters now waits on this lock: the check hangs.
        await conn.execute("LOCK TABLE projection_dead_letters IN ACCESS EXCLUSIVE MODE")
        for _ in range(3):  # later probes share the hung check, and do not wait either
            r, took = await probe(stack)
            assert r.status_code == 503 and took < WITHIN_S, (r.text, took)
            assert r.json()["checks"]["error"] == "timeout"
    await until_status(stack, 200)


@pytest.fixture()
async def own_stack(
    tmp_path: Path, postgres_server: EmbeddedPostgres
) -> AsyncIterator[tuple[Stack, EmbeddedNats]]:
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        with fresh_database(postgres_server, "rz_") as url:
            prefix = "R" + uuid.uuid4().hex[:10].upper()
            async with running_stack(server.url, url, prefix, tmp_path / "data") as s:
                yield s, server
    finally:
        server.stop()


async def test_nats_down_is_not_ready_within_the_bound(
    own_stack: tuple[Stack, EmbeddedNats],
) -> None:
    stack, server = own_stack
    await until_status(stack, 200)
    server.stop()
    body = await until_status(stack, 503, within=5)
    assert body["checks"]["nats"] is False
    # The usage follower notices too (its consumer stalls): unready until it is back.
    deadline = time.monotonic() + 20
    while body["checks"]["usage_follower"]:
        assert time.monotonic() < deadline, "the usage follower still reads as live"
        await asyncio.sleep(0.2)
        body = await until_status(stack, 503, within=1)
    server.start()
    body = await until_status(stack, 200, within=30)
    assert body["checks"]["usage_follower"]
