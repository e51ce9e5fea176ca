"""Projections on real JetStream and Postgres: visibility, crash and resume, rebuild."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client as NATS

from bench.ledger.ingest import make_events
from events.control import (
    ApiKeyIssued,
    ApiKeyRevoked,
    LimitsSet,
    PricePlanSet,
    SkuPublished,
    SkuRetired,
    TenantCreated,
    TenantLabelsSet,
    TenantSuspended,
)
from events.projections import (
    Entry,
    ProjectionLocked,
    Projector,
    ReadModelsProjection,
    UsageLedgerProjection,
    all_projections,
    committed_positions,
)
from events.store import EventStore
from events.usage import GatewayDelivered, encode_usage, usage_subject
from tokenmill.tasks import cancel_and_wait


async def _publish_usage(nc: NATS, prefix: str, n: int, duplicates: int = 0) -> dict[str, int]:
    """n RequestFinished (+ `duplicates` re-sent under new message ids, + a GatewayDelivered
    per 10th request); returns the ledger's expected count and token sums."""
    js = nc.jetstream(publish_async_max_pending=5000)
    events = make_events(n)
    for i, e in enumerate(events):
        subject = usage_subject(prefix, "worker", e.sku_id)
        await js.publish_async(
            subject, encode_usage(e), headers={"Nats-Msg-Id": f"req:{e.request_id}"}
        )
        if i < duplicates:
            await js.publish_async(
                subject, encode_usage(e), headers={"Nats-Msg-Id": f"again:{e.request_id}"}
            )
        if i % 10 == 0:
            delivered = GatewayDelivered(
                request_id=e.request_id, tenant_id=e.tenant_id, key_id=e.key_id, sku_id=e.sku_id, gateway_id="g",
                prompt_tokens=e.prompt_tokens, completion_tokens=e.completion_tokens, finish_reason="stop",
                finished_at=e.finished_at,
            )  # fmt: skip
            await js.publish_async(
                usage_subject(prefix, "gateway", e.sku_id), encode_usage(delivered)
            )
    await js.publish_async_completed()
    return {
        "rows": n,
        "prompt": sum(e.prompt_tokens for e in events),
        "completion": sum(e.completion_tokens for e in events),
    }


async def _ledger(conn: asyncpg.Connection) -> dict[str, int]:
    row = await conn.fetchrow(
        "SELECT count(*) AS rows, coalesce(sum(prompt_tokens), 0) AS prompt, coalesce(sum(completion_tokens), 0) AS completion FROM usage_ledger"
    )
    return {k: int(v) for k, v in row.items()}


async def _snapshot(database_url: str) -> dict[str, list[tuple[object, ...]]]:
    conn = await asyncpg.connect(database_url)
    try:
        return {
            table: [tuple(r) for r in await conn.fetch(f"SELECT * FROM {table} ORDER BY 1, 2")]
            for p in all_projections()
            for table in p.tables
        }
    finally:
        await conn.close()


async def _control_history(store: EventStore) -> None:
    await store.append(TenantCreated(tenant_id="t1", name="acme", labels={"team": "ml"}), 0)
    await store.append(TenantCreated(tenant_id="t2", name="globex"), 0)
    await store.append(
        SkuPublished(
            sku_id="s1",
            name="llama",
            model="m",
            runtime="tokenmill",
            runtime_config={"tp": 1},
            gpu_type="H200",
        ),
        0,
    )
    await store.append(
        ApiKeyIssued(key_id="k1", tenant_id="t1", key_hash="h1", prefix="tm_1", scopes=["llama"]), 0
    )
    await store.append(ApiKeyIssued(key_id="k2", tenant_id="t2", key_hash="h2", prefix="tm_2"), 0)
    for i, price in enumerate(["0.10", "0.08"]):
        await store.append(
            PricePlanSet(plan_id=f"p{i}", sku_id="s1", input_per_mtok=price, cached_input_per_mtok="0.01",
                         output_per_mtok="0.4", currency="USD", effective_from=TenantCreated(tenant_id="x", name="x").occurred_at),
            None,
        )  # fmt: skip
    await store.append(TenantLabelsSet(tenant_id="t1", labels={"team": "infra"}), None)
    await store.append(ApiKeyRevoked(key_id="k2", tenant_id="t2"), None)
    await store.append(TenantSuspended(tenant_id="t2", reason="unpaid"), None)
    await store.append(SkuRetired(sku_id="s1"), None)


async def test_suspension_and_revocation_visible_within_a_second(
    nc: NATS, store: EventStore, database_url: str
) -> None:
    await store.append(TenantCreated(tenant_id="t1", name="acme"), 0)
    await store.append(ApiKeyIssued(key_id="k1", tenant_id="t1", key_hash="h1", prefix="tm_1"), 0)
    projector = Projector(nc, database_url, store.layout, ReadModelsProjection())
    task = asyncio.create_task(projector.run())
    conn = await asyncpg.connect(database_url)
    try:
        await projector.wait_caught_up(2)
        t0 = time.monotonic()
        await store.append(TenantSuspended(tenant_id="t1"), None)
        await store.append(ApiKeyRevoked(key_id="k1", tenant_id="t1"), None)
        while True:
            status = await conn.fetchval("SELECT status FROM tenants WHERE tenant_id = 't1'")
            revoked = await conn.fetchval("SELECT revoked_at FROM api_keys WHERE key_id = 'k1'")
            if status == "suspended" and revoked is not None:
                break
            assert time.monotonic() - t0 < 1.0, "not visible in the read models within 1 s"
            await asyncio.sleep(0.005)
    finally:
        await asyncio.gather(cancel_and_wait(task), return_exceptions=True)
        await conn.close()


async def test_limits_have_no_read_model(nc: NATS, store: EventStore, database_url: str) -> None:
    """Admission folds limits from the stream; the read models pass LimitsSet by (no table,
    no dead letter), a key-scoped one included."""
    await store.append(TenantCreated(tenant_id="t1", name="acme"), 0)
    await store.append(LimitsSet(tenant_id="t1", requests_per_minute=10), None)
    await store.append(LimitsSet(tenant_id="t1", sku_id="s1", token_quota=5), None)
    projector = Projector(nc, database_url, store.layout, ReadModelsProjection())
    task = asyncio.create_task(projector.run())
    conn = await asyncpg.connect(database_url)
    try:
        await projector.wait_caught_up(3)
        assert await conn.fetchval("SELECT count(*) FROM tenants") == 1
        assert await conn.fetchval("SELECT to_regclass('tenant_limits')") is None
        assert await conn.fetchval("SELECT count(*) FROM projection_dead_letters") == 0
    finally:
        await asyncio.gather(cancel_and_wait(task), return_exceptions=True)
        await conn.close()


class _StallingLedger(UsageLedgerProjection):
    """Writes half of its second batch, then stalls: the moment to cancel it."""

    def __init__(self) -> None:
        self.batches = 0
        self.stalled = asyncio.Event()

    async def apply(self, conn: asyncpg.Connection, batch: Sequence[Entry]) -> None:
        self.batches += 1
        if self.batches == 2:
            await super().apply(conn, batch[: len(batch) // 2])
            self.stalled.set()
            await asyncio.sleep(3600)
        await super().apply(conn, batch)


async def test_cancelled_mid_batch_loses_and_doubles_nothing(
    nc: NATS, store: EventStore, database_url: str
) -> None:
    expected = await _publish_usage(nc, store.layout.prefix, 12_000, duplicates=500)
    head = await store.head(store.layout.usage_stream)
    stalling = _StallingLedger()
    projector = Projector(nc, database_url, store.layout, stalling, batch_size=2000)
    task = asyncio.create_task(projector.run())
    await asyncio.wait_for(stalling.stalled.wait(), 30)
    await asyncio.gather(cancel_and_wait(task), return_exceptions=True)
    conn = await asyncpg.connect(database_url)
    try:
        # Only the first batch is committed; the half-written second one was rolled back.
        position = (await committed_positions(conn))["usage_ledger"]
        assert 0 < position < head
        assert (await _ledger(conn))["rows"] == await conn.fetchval(
            "SELECT count(*) FROM usage_ledger WHERE stream_seq <= $1", position
        )
        await Projector(
            nc, database_url, store.layout, UsageLedgerProjection(), batch_size=2000
        ).run(until_seq=head)
        assert await _ledger(conn) == expected
        assert await conn.fetchval("SELECT count(*) FROM gateway_deliveries") == 1200
    finally:
        await conn.close()


def _tokenmill(
    database_url: str, nats_url: str, prefix: str, tmp: Path, *args: str
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TOKENMILL_NATS_URL": nats_url, "TOKENMILL_DATABASE_URL": database_url,
           "TOKENMILL_STREAM_PREFIX": prefix, "TOKENMILL_DATA_DIR": str(tmp)}  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


async def test_killed_projector_process_resumes_exactly(
    nc: NATS, store: EventStore, database_url: str, nats_server, tmp_path: Path
) -> None:
    expected = await _publish_usage(nc, store.layout.prefix, 60_000, duplicates=1000)
    head = await store.head(store.layout.usage_stream)
    conn = await asyncpg.connect(database_url)
    try:
        proc = _tokenmill(database_url, nats_server.url, store.layout.prefix, tmp_path, "project")
        try:
            # Kill -9 once some batches are committed, while the rest are in flight.
            deadline = time.monotonic() + 60
            while (await committed_positions(conn)).get("usage_ledger", 0) < 5000:
                assert proc.poll() is None and time.monotonic() < deadline
                await asyncio.sleep(0.005)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        position = (await committed_positions(conn))["usage_ledger"]
        assert position < head, "the projector finished before it was killed"
        proc = _tokenmill(database_url, nats_server.url, store.layout.prefix, tmp_path, "project")
        try:
            deadline = time.monotonic() + 90
            while (await committed_positions(conn)).get("usage_ledger", 0) < head:
                assert proc.poll() is None and time.monotonic() < deadline
                await asyncio.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        assert await _ledger(conn) == expected
    finally:
        await conn.close()


async def test_rebuild_yields_identical_tables(
    nc: NATS, store: EventStore, database_url: str, nats_server, tmp_path: Path
) -> None:
    await _control_history(store)
    await _publish_usage(nc, store.layout.prefix, 3000, duplicates=100)
    for projection in all_projections():
        head = await store.head(projection.stream(store.layout))
        await Projector(nc, database_url, store.layout, projection, batch_size=500).run(
            until_seq=head
        )
    before = await _snapshot(database_url)
    assert (
        len(before["usage_ledger"]) == 3000
        and len(before["tenants"]) == 2
        and len(before["price_plans"]) == 2
    )

    proc = _tokenmill(
        database_url, nats_server.url, store.layout.prefix, tmp_path, "projections", "rebuild"
    )
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out
    assert "rebuilt read_models" in out and "rebuilt usage_ledger" in out
    assert await _snapshot(database_url) == before


async def test_one_projector_per_projection_others_stand_by(
    nc: NATS, store: EventStore, database_url: str
) -> None:
    await store.append(TenantCreated(tenant_id="t1", name="acme"), 0)
    active = Projector(nc, database_url, store.layout, ReadModelsProjection())
    task = asyncio.create_task(active.run())
    try:
        await active.wait_caught_up(1)
        with pytest.raises(ProjectionLocked):
            await Projector(nc, database_url, store.layout, ReadModelsProjection()).run(
                until_seq=1, standby=False
            )
        # A standby takes over once the active one stops.
        standby = asyncio.create_task(
            Projector(nc, database_url, store.layout, ReadModelsProjection()).run(until_seq=2)
        )
        await asyncio.sleep(0.3)
        assert not standby.done()
    finally:
        await asyncio.gather(cancel_and_wait(task), return_exceptions=True)
    await store.append(TenantSuspended(tenant_id="t1"), None)
    await asyncio.wait_for(standby, 10)
    conn = await asyncpg.connect(database_url)
    try:
        assert (
            await conn.fetchval("SELECT status FROM tenants WHERE tenant_id = 't1'") == "suspended"
        )
    finally:
        await conn.close()
