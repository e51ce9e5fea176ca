"""Invoices: a pure function of (usage ledger rows, price history, an "as of" cut).

What an invoice bills (tenant T, period P, cut S, the previous invoice's period end E and cut S'):
- usage lines: T's requests that finished in P and reached the usage stream at or before S;
- adjustment lines: T's requests that finished before P, reached the stream at or before S,
  and were not billed before: they arrived after the previous invoice's cut (S' < seq), or they
  fall in a gap after the previous invoice's period (finished at or after E).
So every request is billed exactly once, and a request that arrives late for a finalized
period lands on the next invoice as an adjustment; a finalized invoice never changes.

Lines are per SKU x token class (input = prompt - cached, cached input, output) x the plan in
force when the request finished, so a price change mid-period splits a line in two. Cached
input is a line of its own at the plan's cached-input price, or at its input price when the
plan has none. A line amount is its exact cost rounded half-even to the currency's minor unit
(pricing.money).

The cut is a usage-stream sequence: the ledger commits its stream position with each row, so
"every row with seq <= S" is a fixed set that a rebuild from the log reproduces exactly.

Size: An invoice is one pure function with its line, adjustment and rounding rules, kept
together so that the rules read in one place.
"""

from __future__ import annotations

import csv
import hashlib
import io
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Literal

import msgspec

from pricing.money import exact_cost, exact_sum, line_amount, plain
from pricing.periods import BillingPeriod, utc
from pricing.plans import TOKEN_CLASSES, PriceBook, PricePlan, TokenClass

Category = Literal["usage", "adjustment"]
Status = Literal["draft", "finalized"]


class LedgerRow(msgspec.Struct, frozen=True, kw_only=True):
    """One finished request as the usage ledger records it (events.usage.RequestFinished plus
    where it sits in the usage stream)."""

    request_id: str
    tenant_id: str
    key_id: str
    sku_id: str
    model: str
    worker_id: str = ""
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int
    finish_reason: str
    started_at: datetime
    finished_at: datetime
    stream_seq: int  # usage-stream sequence of the event: the order the "as of" cut follows
    received_at: datetime | None = None  # when the event reached the stream

    @property
    def usage_at(self) -> datetime:
        """The instant that picks the billing period and the plan in force: the request's end,
        when its token counts became final."""
        return self.finished_at

    def tokens(self, token_class: TokenClass) -> int:
        # A cached count above the prompt count would be a worker bug; bill it as all-cached
        # rather than produce a negative input quantity.
        cached = min(max(self.cached_tokens, 0), self.prompt_tokens)
        if token_class is TokenClass.input:
            return self.prompt_tokens - cached
        if token_class is TokenClass.cached_input:
            return cached
        return self.completion_tokens


@dataclass(frozen=True)
class Charge:
    """One ledger row's tokens of one class, priced by the plan in force."""

    row: LedgerRow
    token_class: TokenClass
    quantity: int
    plan: PricePlan
    category: Category
    usage_period: BillingPeriod  # the period the usage belongs to (earlier for adjustments)

    @property
    def exact_amount(self) -> Decimal:
        return exact_cost(self.quantity, self.plan.unit_price(self.token_class))

    @property
    def line_key(self) -> tuple[object, ...]:
        """Charges with equal keys add up to one invoice line."""
        return (
            self.category,
            utc(self.usage_period.start),
            self.row.sku_id,
            TOKEN_CLASSES.index(self.token_class),
            utc(self.plan.effective_from),
            self.plan.plan_id,
        )


class UnpricedUsage(msgspec.Struct, frozen=True, kw_only=True):
    """Usage of a SKU that had no price plan in force: listed on the invoice, billed at nothing,
    flagged by the reconciliation report."""

    category: str
    sku_id: str
    token_class: str
    quantity: int
    requests: int


class PreviousInvoice(msgspec.Struct, frozen=True):
    """What the next invoice needs of the previous one: where it ended and its cut."""

    period_end: datetime
    cut_seq: int


class InvoiceBasis(msgspec.Struct, frozen=True, kw_only=True):
    """Everything besides ledger and prices that determines an invoice."""

    tenant_id: str
    period: BillingPeriod
    currency: str
    cut_seq: int
    previous: PreviousInvoice | None = None  # None: the tenant's first invoice
    # Price plans recorded up to this control-stream sequence (None: all of them), so a
    # rebuild prices exactly as the original did even if plans were added since.
    price_cut_seq: int | None = None

    def __post_init__(self) -> None:
        if self.previous is not None and self.cut_seq < self.previous.cut_seq:
            raise ValueError(
                f"cut {self.cut_seq} is before the previous invoice's cut {self.previous.cut_seq}"
            )

    def category_of(self, row: LedgerRow) -> Category | None:
        """Which part of this invoice bills the row, or None if another invoice does."""
        if row.tenant_id != self.tenant_id or row.stream_seq > self.cut_seq:
            return None
        at = utc(row.usage_at)
        if self.period.contains(at):
            return "usage"
        if at >= utc(self.period.start):
            return None  # a later period's usage
        previous = self.previous
        if previous is None or row.stream_seq > previous.cut_seq or at >= utc(previous.period_end):
            return "adjustment"
        return None  # billed by an earlier invoice


class InvoiceLine(msgspec.Struct, frozen=True, kw_only=True):
    category: str
    sku_id: str
    token_class: str
    plan_id: str
    unit_price_per_mtok: Decimal
    quantity: int
    amount: Decimal
    requests: int
    # The part of the usage period in which this plan was in force.
    charge_period_start: datetime
    charge_period_end: datetime
    description: str


class Invoice(msgspec.Struct, frozen=True, kw_only=True):
    invoice_id: str
    tenant_id: str
    currency: str
    period_start: datetime
    period_end: datetime
    cut_seq: int
    previous_cut_seq: int | None
    previous_period_end: datetime | None
    price_cut_seq: int | None
    lines: tuple[InvoiceLine, ...]
    usage_total: Decimal
    adjustments_total: Decimal
    total: Decimal
    unpriced: tuple[UnpricedUsage, ...] = ()
    status: str = "draft"
    finalized_at: datetime | None = None

    @property
    def period(self) -> BillingPeriod:
        return BillingPeriod(self.period_start, self.period_end)

    @property
    def basis(self) -> InvoiceBasis:
        previous = None
        if self.previous_cut_seq is not None and self.previous_period_end is not None:
            previous = PreviousInvoice(self.previous_period_end, self.previous_cut_seq)
        return InvoiceBasis(
            tenant_id=self.tenant_id,
            period=self.period,
            currency=self.currency,
            cut_seq=self.cut_seq,
            previous=previous,
            price_cut_seq=self.price_cut_seq,
        )

    @property
    def content_digest(self) -> str:
        """sha256 of what was billed (not of the status): equal for an invoice and its rebuild."""
        content = msgspec.structs.replace(self, status="draft", finalized_at=None)
        return hashlib.sha256(invoice_json(content)).hexdigest()


class CurrencyMismatch(ValueError):
    pass


class InvoiceAlreadyFinalized(RuntimeError):
    pass


_SAFE_ID = re.compile(r"[^A-Za-z0-9_-]")


def invoice_id(tenant_id: str, period: BillingPeriod) -> str:
    """Deterministic and safe as a NATS subject token: inv_<tenant>_<YYYYMM>."""
    stamp = (
        period.label.replace("-", "")
        if period.is_calendar_month
        else f"{utc(period.start):%Y%m%d%H%M}"
    )
    return f"inv_{_SAFE_ID.sub('_', tenant_id)}_{stamp}"


def dedupe(rows: Iterable[LedgerRow]) -> list[LedgerRow]:
    """One row per request (the ledger is unique on request id; this guards raw inputs): the
    earliest in the stream wins, as it does in the projection."""
    first: dict[str, LedgerRow] = {}
    for row in rows:
        kept = first.get(row.request_id)
        if kept is None or row.stream_seq < kept.stream_seq:
            first[row.request_id] = row
    return list(first.values())


def price_row(
    row: LedgerRow, book: PriceBook, category: Category, usage_period: BillingPeriod
) -> Iterator[Charge | tuple[Category, str, TokenClass, int]]:
    """The row's non-zero token classes, each priced; unpriced ones as (category, sku, class, qty)."""
    plan = book.in_force(row.sku_id, row.usage_at)
    for token_class in TOKEN_CLASSES:
        quantity = row.tokens(token_class)
        if quantity <= 0:
            continue
        if plan is None:
            yield (category, row.sku_id, token_class, quantity)
        else:
            yield Charge(row, token_class, quantity, plan, category, usage_period)


def invoice_charges(
    basis: InvoiceBasis, rows: Iterable[LedgerRow], book: PriceBook
) -> tuple[list[Charge], tuple[UnpricedUsage, ...]]:
    """The priced charges an invoice bills, and its unpriced usage."""
    charges: list[Charge] = []
    unpriced: dict[tuple[str, str, str], list[int]] = {}
    for row in dedupe(rows):
        category = basis.category_of(row)
        if category is None:
            continue
        usage_period = (
            basis.period if category == "usage" else BillingPeriod.containing(row.usage_at)
        )
        for priced in price_row(row, book, category, usage_period):
            if isinstance(priced, Charge):
                if priced.plan.currency != basis.currency:
                    raise CurrencyMismatch(
                        f"plan {priced.plan.plan_id} is in {priced.plan.currency}, invoice in {basis.currency}"
                    )
                charges.append(priced)
            else:
                cat, sku_id, token_class, quantity = priced
                counts = unpriced.setdefault((cat, sku_id, token_class.value), [0, 0])
                counts[0] += quantity
                counts[1] += 1
    unpriced_usage = tuple(
        UnpricedUsage(category=c, sku_id=s, token_class=t, quantity=q, requests=n)
        for (c, s, t), (q, n) in sorted(unpriced.items())
    )
    return charges, unpriced_usage


def group_charges(charges: Iterable[Charge]) -> dict[tuple[object, ...], list[Charge]]:
    """Charges by invoice line, in canonical line order."""
    groups: dict[tuple[object, ...], list[Charge]] = {}
    for charge in charges:
        groups.setdefault(charge.line_key, []).append(charge)
    return {key: groups[key] for key in sorted(groups, key=_sortable)}


def _sortable(key: tuple[object, ...]) -> tuple[object, ...]:
    category = key[0]
    return (0 if category == "usage" else 1, *key[1:])


def _line(charges: list[Charge], book: PriceBook, currency: str) -> InvoiceLine:
    first = charges[0]
    plan, token_class, period = first.plan, first.token_class, first.usage_period
    quantity = sum(c.quantity for c in charges)
    unit_price = plan.unit_price(token_class)
    until = book.in_force_until(plan)
    start = max(utc(period.start), utc(plan.effective_from))
    end = min(utc(period.end), utc(until)) if until is not None else utc(period.end)
    label = token_class.value.replace("_", " ")
    description = (
        f"{first.row.sku_id} {label} tokens at {plain(unit_price)} {currency}/1M ({plan.plan_id})"
    )
    if token_class is TokenClass.cached_input and plan.cached_input_per_mtok is None:
        description += ", the input price: the plan has no cached-input price"
    if first.category == "adjustment":
        description = f"Late usage from {period.label}: {description}"
    return InvoiceLine(
        category=first.category,
        sku_id=first.row.sku_id,
        token_class=token_class.value,
        plan_id=plan.plan_id,
        unit_price_per_mtok=unit_price,
        quantity=quantity,
        amount=line_amount(quantity, unit_price, currency),
        requests=len(charges),
        charge_period_start=start,
        charge_period_end=end,
        description=description,
    )


def build_invoice(
    basis: InvoiceBasis, rows: Iterable[LedgerRow], plans: Iterable[PricePlan] | PriceBook
) -> Invoice:
    """The draft invoice for `basis`: the same inputs give the same invoice, byte for byte."""
    book = (plans if isinstance(plans, PriceBook) else PriceBook(plans)).as_of(basis.price_cut_seq)
    charges, unpriced = invoice_charges(basis, rows, book)
    lines = tuple(_line(group, book, basis.currency) for group in group_charges(charges).values())
    usage_total = exact_sum(line.amount for line in lines if line.category == "usage")
    adjustments_total = exact_sum(line.amount for line in lines if line.category == "adjustment")
    zero = line_amount(0, Decimal(0), basis.currency)  # 0.00 at the currency's scale
    previous = basis.previous
    return Invoice(
        invoice_id=invoice_id(basis.tenant_id, basis.period),
        tenant_id=basis.tenant_id,
        currency=basis.currency,
        period_start=utc(basis.period.start),
        period_end=utc(basis.period.end),
        cut_seq=basis.cut_seq,
        previous_cut_seq=previous.cut_seq if previous else None,
        previous_period_end=utc(previous.period_end) if previous else None,
        price_cut_seq=basis.price_cut_seq,
        lines=lines,
        usage_total=usage_total + zero,
        adjustments_total=adjustments_total + zero,
        total=usage_total + adjustments_total + zero,
        unpriced=unpriced,
    )


def finalize(invoice: Invoice, at: datetime) -> Invoice:
    """Draft -> finalized. A finalized invoice is never changed; late usage goes to the next."""
    if invoice.status == "finalized":
        raise InvoiceAlreadyFinalized(
            f"{invoice.invoice_id} was finalized at {invoice.finalized_at}"
        )
    return msgspec.structs.replace(invoice, status="finalized", finalized_at=utc(at))


def next_basis(previous: Invoice, cut_seq: int, price_cut_seq: int | None = None) -> InvoiceBasis:
    """The basis of the invoice that follows `previous` for the same tenant."""
    return InvoiceBasis(
        tenant_id=previous.tenant_id,
        period=previous.period.following(),
        currency=previous.currency,
        cut_seq=cut_seq,
        previous=PreviousInvoice(previous.period_end, previous.cut_seq),
        price_cut_seq=price_cut_seq,
    )


# Exports ------------------------------------------------------------------------------------

_json_encoder = msgspec.json.Encoder(decimal_format="string")


def invoice_json(invoice: Invoice) -> bytes:
    """The invoice document: fields in declaration order, decimals as strings, UTC instants."""
    return _json_encoder.encode(invoice)


def invoice_from_json(data: bytes) -> Invoice:
    return msgspec.json.decode(data, type=Invoice)


INVOICE_CSV_COLUMNS = (
    "invoice_id",
    "tenant_id",
    "status",
    "currency",
    "period_start",
    "period_end",
    "line",
    "category",
    "sku_id",
    "token_class",
    "plan_id",
    "charge_period_start",
    "charge_period_end",
    "quantity",
    "unit_price_per_mtok",
    "amount",
    "requests",
    "description",
    "unpriced",  # true: usage of a SKU with no price plan in force, listed at no cost
)


def iso(at: datetime) -> str:
    return utc(at).isoformat().replace("+00:00", "Z")


def invoice_csv(invoice: Invoice) -> bytes:
    """One row per line, then one per unpriced (SKU, token class), flagged and at 0; the
    amount column sums to the invoice total."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(INVOICE_CSV_COLUMNS)
    # The invoice's own columns, the same on every row
    head = (
        invoice.invoice_id,
        invoice.tenant_id,
        invoice.status,
        invoice.currency,
        iso(invoice.period_start),
        iso(invoice.period_end),
    )
    for number, line in enumerate(invoice.lines, start=1):
        writer.writerow(
            (
                *head,
                number,
                line.category,
                line.sku_id,
                line.token_class,
                line.plan_id,
                iso(line.charge_period_start),
                iso(line.charge_period_end),
                line.quantity,
                plain(line.unit_price_per_mtok),
                plain(line.amount),
                line.requests,
                line.description,
                "false",
            )
        )
    zero = plain(line_amount(0, Decimal(0), invoice.currency))
    for number, usage in enumerate(invoice.unpriced, start=len(invoice.lines) + 1):
        label = usage.token_class.replace("_", " ")
        description = f"{usage.sku_id} {label} tokens: no price plan in force, not billed"
        if usage.category == "adjustment":
            description = f"Late usage: {description}"
        writer.writerow(
            (
                *head,
                number,
                usage.category,
                usage.sku_id,
                usage.token_class,
                "",
                iso(invoice.period_start),
                iso(invoice.period_end),
                usage.quantity,
                "",
                zero,
                usage.requests,
                description,
                "true",
            )
        )
    return out.getvalue().encode()
