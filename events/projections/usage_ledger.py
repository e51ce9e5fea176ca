"""The usage ledger: one row per request (from RequestFinished, the bill: what was delivered),
one per gateway delivery (GatewayDelivered) and one per worker generation (WorkerGenerated),
the last two for reconciliation.

Ingest is the hot path of the projections: a batch is COPYed into an unlogged-per-session
staging table and moved with one INSERT ... ON CONFLICT DO NOTHING, so a request id that
arrives twice (a retry beyond the dedupe window) keeps its first row."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import asyncpg
import msgspec

from events.projections.runner import Entry
from events.store import StreamLayout
from events.usage import (
    GatewayDelivered,
    RequestFinished,
    UsageEvent,
    WorkerGenerated,
    usage_stream_name,
)

log = logging.getLogger(__name__)

LEDGER_COLUMNS = (
    "request_id",
    "tenant_id",
    "key_id",
    "sku_id",
    "model",
    "worker_id",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "finish_reason",
    "ttft_ms",
    "e2e_ms",
    "started_at",
    "finished_at",
    "stream_seq",
    "unbilled_waste_tokens",
)
DELIVERY_COLUMNS = (
    "request_id",
    "tenant_id",
    "key_id",
    "sku_id",
    "gateway_id",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "client_disconnected",
    "finished_at",
    "stream_seq",
    "worker_lost",
)
GENERATION_COLUMNS = (
    "request_id",
    "tenant_id",
    "sku_id",
    "worker_id",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "finish_reason",
    "gateway_lost",
    "finished_at",
    "stream_seq",
)

DDL = """
CREATE TABLE IF NOT EXISTS usage_ledger (
    request_id text PRIMARY KEY,
    tenant_id text NOT NULL,
    key_id text NOT NULL,
    sku_id text NOT NULL,
    model text NOT NULL,
    worker_id text NOT NULL,
    prompt_tokens integer NOT NULL,
    cached_tokens integer NOT NULL,
    completion_tokens integer NOT NULL,
    finish_reason text NOT NULL,
    ttft_ms double precision,
    e2e_ms double precision NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    stream_seq bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_ledger_tenant_time ON usage_ledger (tenant_id, finished_at);
CREATE TABLE IF NOT EXISTS gateway_deliveries (
    request_id text PRIMARY KEY,
    tenant_id text NOT NULL,
    key_id text NOT NULL,
    sku_id text NOT NULL,
    gateway_id text NOT NULL,
    prompt_tokens integer NOT NULL,
    completion_tokens integer NOT NULL,
    finish_reason text NOT NULL,
    client_disconnected boolean NOT NULL,
    finished_at timestamptz NOT NULL,
    stream_seq bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS worker_generations (
    request_id text PRIMARY KEY,
    tenant_id text NOT NULL,
    sku_id text NOT NULL,
    worker_id text NOT NULL,
    prompt_tokens integer NOT NULL,
    cached_tokens integer NOT NULL,
    completion_tokens integer NOT NULL,
    finish_reason text NOT NULL,
    gateway_lost boolean NOT NULL,
    finished_at timestamptz NOT NULL,
    stream_seq bigint NOT NULL
);
ALTER TABLE usage_ledger ADD COLUMN IF NOT EXISTS unbilled_waste_tokens integer NOT NULL DEFAULT 0;
ALTER TABLE gateway_deliveries ADD COLUMN IF NOT EXISTS worker_lost boolean NOT NULL DEFAULT false;
"""

_decoder = msgspec.json.Decoder(UsageEvent)


class UsageLedgerProjection:
    name = "usage_ledger"
    tables: tuple[str, ...] = ("usage_ledger", "gateway_deliveries", "worker_generations")
    ddl = DDL

    def stream(self, layout: StreamLayout) -> str:
        return usage_stream_name(layout.prefix)

    async def apply(self, conn: asyncpg.Connection, batch: Sequence[Entry]) -> None:
        ledger: list[tuple[object, ...]] = []
        deliveries: list[tuple[object, ...]] = []
        generations: list[tuple[object, ...]] = []
        decode = _decoder.decode
        for seq, data in batch:
            try:
                e = decode(data)
            except msgspec.DecodeError:
                log.warning("usage_ledger: skipping undecodable event at seq %d", seq)
                continue
            if isinstance(e, RequestFinished):
                ledger.append(
                    (
                        e.request_id,
                        e.tenant_id,
                        e.key_id,
                        e.sku_id,
                        e.model,
                        e.worker_id,
                        e.prompt_tokens,
                        e.cached_tokens,
                        e.completion_tokens,
                        e.finish_reason,
                        e.ttft_ms,
                        e.e2e_ms,
                        e.started_at,
                        e.finished_at,
                        seq,
                        e.unbilled_waste_tokens,
                    )
                )
            elif isinstance(e, GatewayDelivered):
                deliveries.append(
                    (
                        e.request_id,
                        e.tenant_id,
                        e.key_id,
                        e.sku_id,
                        e.gateway_id,
                        e.prompt_tokens,
                        e.completion_tokens,
                        e.finish_reason,
                        e.client_disconnected,
                        e.finished_at,
                        seq,
                        e.worker_lost,
                    )
                )
            elif isinstance(e, WorkerGenerated):
                generations.append(
                    (
                        e.request_id,
                        e.tenant_id,
                        e.sku_id,
                        e.worker_id,
                        e.prompt_tokens,
                        e.cached_tokens,
                        e.completion_tokens,
                        e.finish_reason,
                        e.gateway_lost,
                        e.finished_at,
                        seq,
                    )
                )
        if ledger:
            await _insert_new(conn, "usage_ledger", LEDGER_COLUMNS, ledger)
        if deliveries:
            await _insert_new(conn, "gateway_deliveries", DELIVERY_COLUMNS, deliveries)
        if generations:
            await _insert_new(conn, "worker_generations", GENERATION_COLUMNS, generations)


async def _insert_new(
    conn: asyncpg.Connection, table: str, columns: Sequence[str], rows: list[tuple[object, ...]]
) -> None:
    """COPY into a per-session staging table, then insert the rows whose request id is new
    (the earliest stream sequence wins, also within the batch)."""
    stage = f"{table}_stage"
    await conn.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS {stage} (LIKE {table} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
    )
    await conn.copy_records_to_table(stage, records=rows, columns=list(columns))
    cols = ", ".join(columns)
    await conn.execute(
        f"""INSERT INTO {table} ({cols})
            SELECT DISTINCT ON (request_id) {cols} FROM {stage} ORDER BY request_id, stream_seq
            ON CONFLICT (request_id) DO NOTHING"""
    )
