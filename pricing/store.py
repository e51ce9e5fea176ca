"""Billing's Postgres side: reads the usage ledger, gateway deliveries, price plans, tenants and
keys (read models kept by events/), and keeps billing's own tables:

- invoices: finalized invoices, a projection of InvoiceFinalized on the control stream
  (`InvoicesProjection`, rebuildable like every read model); the period-close job also writes
  the row it just published, idempotently, so billing does not wait on a projector.
- usage_rollups: tokens and requests per hour x tenant x key x SKU x model.
- billing_positions: how far each incremental job got (the rollup's ledger sequence).
- capacity_projections, billing_reports: the latest projection per SKU, reconciliation reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import asyncpg
from sqlmodel import col, select

from events.control import control_stream_name
from events.projections.runner import Entry, Projection
from events.projections.tables import (
    ApiKeyRow,
    BillingPositionRow,
    BillingReportRow,
    CapacityProjectionRow,
    InvoiceRow,
    PricePlanRow,
    SkuRow,
    TenantRow,
    UsageRollupRow,
    ddl,
    fetch,
    fetch_one,
    table_names,
)
from events.store import StreamLayout
from pricing.capacity import WorkerBusy
from pricing.events import InvoiceFinalized, decode_invoice_event
from pricing.invoices import Invoice, InvoiceBasis, LedgerRow, invoice_from_json, invoice_json
from pricing.plans import PriceBook, PricePlan
from pricing.showback import Attribution

# The projections in events/ whose positions tell billing how far the read models are.
LEDGER_PROJECTION = "usage_ledger"
CONTROL_PROJECTION = "read_models"

# The tables are declared in events/projections/tables.py with the other read models.
INVOICES_DDL = ddl(InvoiceRow)
BILLING_DDL = ddl(UsageRollupRow, BillingPositionRow, CapacityProjectionRow, BillingReportRow)

# The ledger reads stay hand-written SQL straight into LedgerRow: an invoice or an export
# reads a whole period of the ledger, and a validated table model per row (~30-50 us) would
# cost more than the read. The small read models below are typed select(...)s over the table
# classes.
_LEDGER_SELECT = """SELECT request_id, tenant_id, key_id, sku_id, model, worker_id, prompt_tokens,
    cached_tokens, completion_tokens, finish_reason, started_at, finished_at, stream_seq
    FROM usage_ledger"""


class InvoicesProjection:
    """invoices <- InvoiceFinalized events of the control stream (a events.projections Projection)."""

    name = "invoices"
    tables = table_names(InvoiceRow)
    ddl = INVOICES_DDL

    def stream(self, layout: StreamLayout) -> str:
        return control_stream_name(layout.prefix)

    async def apply(self, conn: asyncpg.Connection, batch: Sequence[Entry]) -> None:
        for seq, data in batch:
            event = decode_invoice_event(data)
            if event is not None:
                await upsert_invoice(conn, event, seq)


async def upsert_invoice(
    conn: asyncpg.Connection | asyncpg.Pool, event: InvoiceFinalized, seq: int
) -> None:
    """Record a finalization; the first record of an invoice id stays (finalized is final)."""
    inv = event.invoice
    await conn.execute(
        """INSERT INTO invoices VALUES ($1, $2, $3, $4, $5, $6, $7::numeric, $8, $9, $10, $11, $12)
           ON CONFLICT (invoice_id) DO NOTHING""",
        inv.invoice_id,
        inv.tenant_id,
        inv.period_start,
        inv.period_end,
        inv.currency,
        inv.cut_seq,
        inv.total,
        inv.status,
        inv.finalized_at,
        event.digest,
        invoice_json(inv).decode(),
        seq,
    )


# Busy time as the union of intervals (gaps and islands): in each worker's rows ordered by
# (started_at, finished_at), a row starts an island when it starts after every earlier row
# ended; an island lasts from its first start to its last end.
_WORKER_BUSY = """
WITH rows AS (
    SELECT coalesce(worker_id, '?') AS worker_id, started_at, finished_at,
           completion_tokens, prompt_tokens,
           max(finished_at) OVER (PARTITION BY coalesce(worker_id, '?')
                                  ORDER BY started_at, finished_at
                                  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS ended
    FROM usage_ledger WHERE sku_id = $1 AND finished_at >= $2 AND finished_at < $3
), islands AS (
    SELECT *, count(*) FILTER (WHERE ended IS NULL OR started_at > ended)
                  OVER (PARTITION BY worker_id ORDER BY started_at, finished_at
                        ROWS UNBOUNDED PRECEDING) AS island
    FROM rows
), spans AS (
    SELECT worker_id, max(finished_at) - min(started_at) AS span,
           sum(completion_tokens) AS completion, sum(prompt_tokens) AS prompt
    FROM islands GROUP BY worker_id, island
)
SELECT worker_id, sum(extract(epoch FROM span)) AS busy,
       sum(completion) AS completion, sum(prompt) AS prompt
FROM spans GROUP BY worker_id ORDER BY worker_id"""


def _ledger_row(record: asyncpg.Record) -> LedgerRow:
    return LedgerRow(**dict(record))


def _invoice(row: InvoiceRow) -> Invoice:
    return invoice_from_json(row.document.encode())


class BillingStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def ensure_schema(self) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('tokenmill.schema'))")
            await conn.execute(INVOICES_DDL)
            await conn.execute(BILLING_DDL)

    # -- positions -------------------------------------------------------------------------

    async def projection_position(self, projection: str) -> int:
        """How far a read model of events/ has committed (0 if it never ran)."""
        seq = await self.pool.fetchval(
            """SELECT last_seq FROM projection_positions WHERE projection = $1""", projection
        )
        return int(seq or 0)

    async def ledger_position(self) -> int:
        return await self.projection_position(LEDGER_PROJECTION)

    async def control_position(self) -> int:
        return await self.projection_position(CONTROL_PROJECTION)

    # -- ledger ----------------------------------------------------------------------------

    async def ledger_rows(
        self,
        *,
        tenant_id: str | None = None,
        sku_id: str | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        cut_seq: int | None = None,
    ) -> list[LedgerRow]:
        """Rows that finished in [start, end), up to `cut_seq`, in stream order."""
        records = await self.pool.fetch(
            _LEDGER_SELECT
            + """ WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2::text IS NULL OR sku_id = $2)
                  AND ($3::timestamptz IS NULL OR finished_at >= $3)
                  AND ($4::timestamptz IS NULL OR finished_at < $4)
                  AND ($5::bigint IS NULL OR stream_seq <= $5)
                ORDER BY stream_seq""",
            tenant_id,
            sku_id,
            start,
            end,
            cut_seq,
        )
        return [_ledger_row(r) for r in records]

    async def worker_busy(self, sku_id: str, start: datetime, end: datetime) -> list[WorkerBusy]:
        """Per worker of the SKU, over the rows that finished in [start, end): the union of
        their [started_at, finished_at] intervals in seconds and their tokens, as
        `pricing.capacity.throughput_from_ledger` counts them, computed in the database: the
        capacity window (a day by default) can hold more rows than a scheduler should."""
        records = await self.pool.fetch(_WORKER_BUSY, sku_id, start, end)
        return [
            WorkerBusy(r["worker_id"], r["busy"], int(r["completion"]), int(r["prompt"]))
            for r in records
        ]

    async def invoice_rows(self, basis: InvoiceBasis) -> list[LedgerRow]:
        """A superset of what `basis` bills (build_invoice picks exactly): the tenant's rows
        up to the cut that finished before the period ended and are new or in the period."""
        previous = basis.previous
        records = await self.pool.fetch(
            _LEDGER_SELECT
            + """ WHERE tenant_id = $1 AND stream_seq <= $2 AND finished_at < $3
                  AND (finished_at >= $4 OR $5::bigint IS NULL OR stream_seq > $5
                       OR finished_at >= $6::timestamptz)
                ORDER BY stream_seq""",
            basis.tenant_id,
            basis.cut_seq,
            basis.period.end,
            basis.period.start,
            previous.cut_seq if previous else None,
            previous.period_end if previous else None,
        )
        return [_ledger_row(r) for r in records]

    async def ledger_tenants(self, before: datetime, cut_seq: int) -> dict[str, datetime]:
        """Tenants with usage before `before` (up to the cut), with their first usage time."""
        records = await self.pool.fetch(
            """SELECT tenant_id, min(finished_at) AS first FROM usage_ledger
               WHERE finished_at < $1 AND stream_seq <= $2 GROUP BY tenant_id ORDER BY tenant_id""",
            before,
            cut_seq,
        )
        return {r["tenant_id"]: r["first"] for r in records}

    # -- control read models ---------------------------------------------------------------

    async def price_book(self) -> PriceBook:
        rows = await fetch(self.pool, PricePlanRow, select(PricePlanRow))
        return PriceBook(
            PricePlan(
                plan_id=r.plan_id,
                sku_id=r.sku_id,
                currency=r.currency,
                input_per_mtok=r.input_per_mtok,
                cached_input_per_mtok=r.cached_input_per_mtok,
                output_per_mtok=r.output_per_mtok,
                effective_from=r.effective_from,
                recorded_seq=r.seq,
            )
            for r in rows
        )

    async def attribution(self) -> Attribution:
        tenants = await fetch(self.pool, TenantRow, select(TenantRow))
        keys = await fetch(self.pool, ApiKeyRow, select(ApiKeyRow))
        return Attribution(
            tenant_names={t.tenant_id: t.name for t in tenants},
            tenant_labels={t.tenant_id: t.labels for t in tenants},
            key_names={k.key_id: k.name or "" for k in keys},
        )

    async def skus(self) -> list[SkuRow]:
        return await fetch(self.pool, SkuRow, select(SkuRow).order_by(col(SkuRow.sku_id)))

    # -- invoices --------------------------------------------------------------------------

    async def invoices(self, tenant_id: str | None = None) -> list[Invoice]:
        query = select(InvoiceRow)
        if tenant_id is not None:
            query = query.where(InvoiceRow.tenant_id == tenant_id)
        query = query.order_by(col(InvoiceRow.tenant_id), col(InvoiceRow.period_start))
        return [_invoice(r) for r in await fetch(self.pool, InvoiceRow, query)]

    async def invoice(self, invoice_id: str) -> Invoice | None:
        query = select(InvoiceRow).where(InvoiceRow.invoice_id == invoice_id)
        row = await fetch_one(self.pool, InvoiceRow, query)
        return _invoice(row) if row is not None else None

    async def latest_invoice(self, tenant_id: str) -> Invoice | None:
        query = (
            select(InvoiceRow)
            .where(InvoiceRow.tenant_id == tenant_id)
            .order_by(col(InvoiceRow.period_start).desc())
            .limit(1)
        )
        row = await fetch_one(self.pool, InvoiceRow, query)
        return _invoice(row) if row is not None else None

    async def record_finalized(self, event: InvoiceFinalized, seq: int) -> None:
        await upsert_invoice(self.pool, event, seq)

    # -- job state -------------------------------------------------------------------------

    async def position(self, conn: asyncpg.Connection, job: str, for_update: bool = False) -> int:
        lock = " FOR UPDATE" if for_update else ""
        seq = await conn.fetchval(
            f"SELECT last_seq FROM billing_positions WHERE job = $1{lock}", job
        )
        return int(seq or 0)

    async def save_position(self, conn: asyncpg.Connection, job: str, seq: int) -> None:
        await conn.execute(
            """INSERT INTO billing_positions VALUES ($1, $2, now())
               ON CONFLICT (job) DO UPDATE SET last_seq = EXCLUDED.last_seq, updated_at = now()""",
            job,
            seq,
        )


def tokenmill_projections() -> list[Projection]:
    """Billing's read models, run with the others (events.projections.all_projections)."""
    return [InvoicesProjection()]
