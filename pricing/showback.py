"""Chargeback / showback: usage and cost by tenant, key, SKU, model and hour or day, as CSV with
FinOps FOCUS (1.0) column names where they fit and `x_`-prefixed custom columns where none does.

Mapping to FOCUS: BillingAccount = tenant, SubAccount = API key, Resource = model,
SkuId = SKU, SkuPriceId = price plan, one row per token class (ConsumedUnit "Tokens", priced per
"1M Tokens"). Late usage billed on a later invoice is ChargeClass "Correction". Tenant and key
labels (cost_centre, team, ...) go to Tags as a JSON object, key labels over tenant labels.

Costs: BilledCost (and Effective/List/ContractedCost) is the row's exact cost, as a plain
decimal at full precision (7 tokens at 3.00 per 1M is 0.000021, not 0.00), so many small
rows add up to what they cost. x_InvoicedCost ties out to the cent: every invoice line's
rounded amount is split over the rows it covers by the largest-remainder method
(pricing.money.allocate), so it sums to the invoice total exactly.

Usage of a SKU with no price plan in force is listed too, flagged `x_Unpriced` = true, at a
cost of 0 with no unit price or SkuPriceId (the invoice lists it the same way).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Literal

from pricing.invoices import (
    Charge,
    InvoiceBasis,
    LedgerRow,
    dedupe,
    group_charges,
    invoice_charges,
    iso,
    price_row,
)
from pricing.money import allocate, exact_cost, exact_sum, line_amount, plain
from pricing.periods import BillingPeriod, floor_to, utc
from pricing.plans import TOKEN_CLASSES, PriceBook

Granularity = Literal["hour", "day"]

FOCUS_COLUMNS = (
    "BillingAccountId",
    "BillingAccountName",
    "SubAccountId",
    "SubAccountName",
    "BillingCurrency",
    "BillingPeriodStart",
    "BillingPeriodEnd",
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "ChargeCategory",
    "ChargeClass",
    "ChargeFrequency",
    "ChargeDescription",
    "BilledCost",
    "EffectiveCost",
    "ListCost",
    "ContractedCost",
    "ListUnitPrice",
    "ContractedUnitPrice",
    "PricingQuantity",
    "PricingUnit",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ProviderName",
    "PublisherName",
    "InvoiceIssuerName",
    "ServiceName",
    "ServiceCategory",
    "SkuId",
    "SkuPriceId",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "Tags",
    "x_TokenClass",
    "x_Requests",
    "x_InvoicedCost",
    "x_Unpriced",
)


@dataclass(frozen=True)
class Attribution:
    """Who the usage belongs to beyond ids: display names and labels of tenants and keys."""

    tenant_names: Mapping[str, str] = field(default_factory=dict)
    tenant_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    key_names: Mapping[str, str] = field(default_factory=dict)
    key_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    provider: str = "tokenmill"
    service_name: str = "tokenmill inference"

    def tags(self, tenant_id: str, key_id: str) -> str:
        merged = {**self.tenant_labels.get(tenant_id, {}), **self.key_labels.get(key_id, {})}
        return json.dumps(merged, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ShowbackRecord:
    tenant_id: str
    key_id: str
    sku_id: str
    model: str
    token_class: str
    plan_id: str  # "" when unpriced
    currency: str
    unit_price_per_mtok: Decimal | None  # None when unpriced
    category: str
    billing_period: BillingPeriod
    charge_period_start: datetime
    charge_period_end: datetime
    quantity: int
    requests: int
    cost: Decimal  # exact, unrounded
    invoiced_cost: Decimal  # the row's share of its rounded invoice line
    priced: bool = True


def _records(
    charges: Iterable[Charge],
    granularity: Granularity,
    billing_period_of: dict[str, BillingPeriod] | None,
    unpriced: Iterable[Unpriced] = (),
) -> list[ShowbackRecord]:
    """Split each line (per tenant) over key x model x hour/day, allocating its rounded amount."""
    by_line: dict[str, list[Charge]] = {}
    for charge in charges:
        by_line.setdefault(charge.row.tenant_id, []).append(charge)
    records: list[ShowbackRecord] = []
    for tenant_id in sorted(by_line):
        for line_charges in group_charges(by_line[tenant_id]).values():
            first = line_charges[0]
            currency = first.plan.currency
            unit_price = first.plan.unit_price(first.token_class)
            cells: dict[tuple[str, str, datetime], list[Charge]] = {}
            for charge in line_charges:
                start, _ = floor_to(charge.row.usage_at, granularity)
                cells.setdefault((charge.row.key_id, charge.row.model, start), []).append(charge)
            keys = sorted(cells)
            exact = [exact_sum(c.exact_amount for c in cells[k]) for k in keys]
            amount = line_amount(sum(c.quantity for c in line_charges), unit_price, currency)
            billing_period = first.usage_period
            if billing_period_of is not None:
                billing_period = billing_period_of[tenant_id]
            for (key_id, model, start), cost, share in zip(
                keys, exact, allocate(amount, exact, currency), strict=True
            ):
                cell = cells[(key_id, model, start)]
                records.append(
                    ShowbackRecord(
                        tenant_id=tenant_id,
                        key_id=key_id,
                        sku_id=first.row.sku_id,
                        model=model,
                        token_class=first.token_class.value,
                        plan_id=first.plan.plan_id,
                        currency=currency,
                        unit_price_per_mtok=unit_price,
                        category=first.category,
                        billing_period=billing_period,
                        charge_period_start=start,
                        charge_period_end=floor_to(start, granularity)[1],
                        quantity=sum(c.quantity for c in cell),
                        requests=len(cell),
                        cost=cost,
                        invoiced_cost=share,
                    )
                )
    records.extend(_unpriced_records(unpriced, granularity, billing_period_of))
    records.sort(
        key=lambda r: (
            r.tenant_id,
            r.charge_period_start,
            r.key_id,
            r.sku_id,
            r.model,
            r.category != "usage",
            not r.priced,
            r.token_class,
            r.plan_id,
        )
    )
    return records


@dataclass(frozen=True)
class Unpriced:
    """A ledger row's tokens of one class with no price plan in force."""

    row: LedgerRow
    token_class: str
    quantity: int
    category: str
    usage_period: BillingPeriod
    currency: str  # the tenant's billing currency


def _unpriced_records(
    items: Iterable[Unpriced],
    granularity: Granularity,
    billing_period_of: dict[str, BillingPeriod] | None,
) -> list[ShowbackRecord]:
    cells: dict[tuple[object, ...], list[Unpriced]] = {}
    for item in items:
        start, _ = floor_to(item.row.usage_at, granularity)
        key = (
            item.row.tenant_id,
            item.category,
            item.row.key_id,
            item.row.sku_id,
            item.row.model,
            item.token_class,
            start,
            item.usage_period.label,
        )
        cells.setdefault(key, []).append(item)
    records = []
    for cell in cells.values():
        first = cell[0]
        tenant_id = first.row.tenant_id
        start, end = floor_to(first.row.usage_at, granularity)
        zero = line_amount(0, Decimal(0), first.currency)
        records.append(
            ShowbackRecord(
                tenant_id=tenant_id,
                key_id=first.row.key_id,
                sku_id=first.row.sku_id,
                model=first.row.model,
                token_class=first.token_class,
                plan_id="",
                currency=first.currency,
                unit_price_per_mtok=None,
                category=first.category,
                billing_period=(
                    billing_period_of[tenant_id] if billing_period_of else first.usage_period
                ),
                charge_period_start=start,
                charge_period_end=end,
                quantity=sum(i.quantity for i in cell),
                requests=len(cell),
                cost=Decimal(0),
                invoiced_cost=zero,
                priced=False,
            )
        )
    return records


def _tenant_currencies(charges: Iterable[Charge], default_currency: str) -> Callable[[str], str]:
    """The currency a tenant's priced usage is in (its unpriced rows are listed in it)."""
    found = {c.row.tenant_id: c.plan.currency for c in charges}
    return lambda tenant_id: found.get(tenant_id, default_currency)


def usage_showback(
    rows: Iterable[LedgerRow],
    plans: PriceBook,
    start: datetime,
    end: datetime,
    granularity: Granularity = "day",
    cut_seq: int | None = None,
    default_currency: str = "USD",
) -> list[ShowbackRecord]:
    """Showback of the usage that finished in [start, end) (as of `cut_seq` if given), priced
    by the plans in force, and the unpriced usage flagged. For a whole period with no late
    usage x_InvoicedCost ties to the invoice."""
    charges: list[Charge] = []
    missing: list[tuple[LedgerRow, str, int, BillingPeriod]] = []
    for row in dedupe(rows):
        at = utc(row.usage_at)
        if not utc(start) <= at < utc(end) or (cut_seq is not None and row.stream_seq > cut_seq):
            continue
        period = BillingPeriod.containing(at)
        for priced in price_row(row, plans, "usage", period):
            if isinstance(priced, Charge):
                charges.append(priced)
            else:
                missing.append((row, priced[2].value, priced[3], period))
    currency_of = _tenant_currencies(charges, default_currency)
    unpriced = [
        Unpriced(row, token_class, quantity, "usage", period, currency_of(row.tenant_id))
        for row, token_class, quantity, period in missing
    ]
    return _records(charges, granularity, None, unpriced)


def invoice_showback(
    basis: InvoiceBasis,
    rows: Iterable[LedgerRow],
    plans: PriceBook,
    granularity: Granularity = "day",
) -> list[ShowbackRecord]:
    """Chargeback of one invoice: its usage and late-usage corrections, x_InvoicedCost summing
    to the invoice total exactly, and its unpriced usage flagged."""
    book = plans.as_of(basis.price_cut_seq)
    charges, _ = invoice_charges(basis, rows, book)
    unpriced = []
    for row in dedupe(rows):
        category = basis.category_of(row)
        if category is None or book.in_force(row.sku_id, row.usage_at) is not None:
            continue
        usage_period = (
            basis.period if category == "usage" else BillingPeriod.containing(row.usage_at)
        )
        for token_class in TOKEN_CLASSES:
            quantity = row.tokens(token_class)
            if quantity > 0:
                unpriced.append(
                    Unpriced(
                        row, token_class.value, quantity, category, usage_period, basis.currency
                    )
                )
    return _records(charges, granularity, {basis.tenant_id: basis.period}, unpriced)


def showback_csv(
    records: Iterable[ShowbackRecord], attribution: Attribution | None = None
) -> bytes:
    who = attribution or Attribution()
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(FOCUS_COLUMNS)
    for r in records:
        cost = plain(r.cost)
        price = "" if r.unit_price_per_mtok is None else plain(r.unit_price_per_mtok)
        label = r.token_class.replace("_", " ")
        description = f"{r.sku_id} {label} tokens at {price} {r.currency} per 1M tokens"
        if not r.priced:
            description = f"{r.sku_id} {label} tokens: no price plan in force, not billed"
        if r.category == "adjustment":
            description += f" (late usage, billed in {r.billing_period.label})"
        writer.writerow(
            (
                r.tenant_id,
                who.tenant_names.get(r.tenant_id, ""),
                r.key_id,
                who.key_names.get(r.key_id, ""),
                r.currency,
                iso(r.billing_period.start),
                iso(r.billing_period.end),
                iso(r.charge_period_start),
                iso(r.charge_period_end),
                "Usage",
                "Correction" if r.category == "adjustment" else "",
                "Usage-Based",
                description,
                cost,
                cost,  # EffectiveCost: no commitment discounts to amortize
                cost,  # ListCost: billed at list price
                cost,  # ContractedCost: no negotiated rates
                price,
                price,
                plain(exact_cost(r.quantity, Decimal(1))),  # PricingQuantity, in 1M tokens
                "1M Tokens",
                r.quantity,
                "Tokens",
                who.provider,
                who.provider,
                who.provider,
                who.service_name,
                "AI and Machine Learning",
                r.sku_id,
                r.plan_id,
                r.model,
                r.model,
                "Model",
                who.tags(r.tenant_id, r.key_id),
                r.token_class,
                r.requests,
                plain(r.invoiced_cost),
                "false" if r.priced else "true",
            )
        )
    return out.getvalue().encode()
