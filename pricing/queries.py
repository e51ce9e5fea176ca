"""What the admin API and the CLI ask of billing: invoices (finalized, or a draft computed now),
showback exports, capacity projections. Thin: the figures come from the pure modules."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import msgspec

from pricing.invoices import Invoice, InvoiceBasis, PreviousInvoice, build_invoice, invoice_id
from pricing.jobs import tenant_currency
from pricing.periods import BillingPeriod, utc
from pricing.showback import Granularity, showback_csv, usage_showback
from pricing.store import BillingStore


async def invoice_for(
    store: BillingStore, tenant_id: str, period: BillingPeriod, default_currency: str = "USD"
) -> Invoice:
    """The finalized invoice of the tenant's period, or else its draft as of the ledger now."""
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
    basis = InvoiceBasis(
        tenant_id=tenant_id,
        period=period,
        currency=default_currency,
        cut_seq=max(await store.ledger_position(), previous.cut_seq if previous else 0),
        previous=PreviousInvoice(previous.period_end, previous.cut_seq) if previous else None,
        price_cut_seq=await store.control_position(),
    )
    rows = await store.invoice_rows(basis)
    book = await store.price_book()
    basis = msgspec.structs.replace(basis, currency=tenant_currency(rows, book, default_currency))
    return build_invoice(basis, rows, book)


async def showback_export(
    store: BillingStore,
    start: datetime,
    end: datetime,
    granularity: Granularity = "day",
    tenant_id: str | None = None,
) -> bytes:
    """FOCUS-style CSV of the usage that finished in [start, end), as of the ledger now."""
    cut = await store.ledger_position()
    rows = await store.ledger_rows(tenant_id=tenant_id, start=start, end=end, cut_seq=cut)
    records = usage_showback(rows, await store.price_book(), start, end, granularity, cut_seq=cut)
    return showback_csv(records, await store.attribution())


async def capacity_projections(store: BillingStore) -> list[dict[str, Any]]:
    """The latest projection per SKU (refreshed by the capacity job)."""
    records = await store.pool.fetch(
        "SELECT sku_id, computed_at, document FROM capacity_projections ORDER BY sku_id"
    )
    return [
        {**json.loads(r["document"]), "computed_at": r["computed_at"].isoformat()} for r in records
    ]
