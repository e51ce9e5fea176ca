"""What the admin API and the CLI ask of billing: invoices (finalized, or a draft computed now),
showback exports, capacity projections. Thin: the figures come from the pure modules."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlmodel import col, select

from events.projections.tables import CapacityProjectionRow, fetch
from pricing.capacity import CapacityProjection, Throughput, project
from pricing.invoices import Invoice, invoice_id
from pricing.jobs import BillingSettings, Cut, capacity_inputs, draft_invoice, measured_throughput
from pricing.periods import BillingPeriod, utc
from pricing.showback import Granularity, showback_csv, usage_showback
from pricing.store import BillingStore


async def invoice_for(
    store: BillingStore, tenant_id: str, period: BillingPeriod, default_currency: str = "USD"
) -> Invoice:
    """The finalized invoice of the tenant's period, or else its draft as of the ledger now.
    Raises ValueError if the usage is priced in several currencies."""
    finalized = await store.invoice(invoice_id(tenant_id, period))
    if finalized is not None:
        return finalized
    previous = next(
        (
            i
            for i in reversed(await store.invoices(tenant_id))
            if utc(i.period_end) <= utc(period.start)
        ),
        None,
    )
    cut = await Cut.now(store)
    return await draft_invoice(store, tenant_id, period, previous, cut, default_currency)


async def showback_export(
    store: BillingStore,
    start: datetime,
    end: datetime,
    granularity: Granularity = "day",
    tenant_id: str | None = None,
    default_currency: str = "USD",
) -> bytes:
    """FOCUS-style CSV of the usage that finished in [start, end), as of the ledger now
    (unpriced usage in `default_currency` for a tenant with no priced usage)."""
    cut = await store.ledger_position()
    rows = await store.ledger_rows(tenant_id=tenant_id, start=start, end=end, cut_seq=cut)
    book = await store.price_book()
    records = usage_showback(
        rows, book, start, end, granularity, cut_seq=cut, default_currency=default_currency
    )
    return showback_csv(records, await store.attribution())


async def capacity_projections(store: BillingStore) -> list[dict[str, Any]]:
    """The latest projection per SKU (refreshed by the capacity job)."""
    query = select(CapacityProjectionRow).order_by(col(CapacityProjectionRow.sku_id))
    rows = await fetch(store.pool, CapacityProjectionRow, query)
    return [{**r.document, "computed_at": r.computed_at.isoformat()} for r in rows]


class NoThroughput(LookupError):
    """Nothing measured for the SKU recently, and no throughput was given."""


async def capacity_what_if(
    store: BillingStore,
    settings: BillingSettings,
    sku_id: str,
    gpu_type: str,
    now: datetime,
    *,
    tok_s: Any = None,
    gpus: int = 1,
    **what_if: Any,
) -> CapacityProjection:
    """One SKU's projection: from `tok_s` if given, else the throughput measured in the recent
    ledger; GPU cost, busy fraction and prices as configured and in force, changed by
    `what_if` (CapacityInputs fields). Raises NoThroughput, or ValueError for bad inputs."""
    if tok_s is not None:
        throughput = Throughput(sku_id, tok_s, gpus=gpus, source="what-if")
    else:
        start = now - timedelta(seconds=settings.capacity_window_s)
        measured = await measured_throughput(store, sku_id, start, now)
        if measured is None:
            raise NoThroughput(f"no usage of {sku_id} in the last {settings.capacity_window_s:g} s")
        throughput = measured
    plan = (await store.price_book()).in_force(sku_id, now)
    return project(throughput, capacity_inputs(settings, gpu_type, plan, **what_if))
