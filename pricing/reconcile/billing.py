"""Reconciliation: does what was billed equal what was served, and do invoices still rebuild?

Three checks:
1. metering: what workers generated, what the gateway delivered and what the ledger billed,
   request by request (billed = delivered, generated = delivered + unbilled waste):
   `pricing.reconcile.metering` (also `tokenmill reconcile`); this report embeds it.
2. billing: every ledger row up to the latest invoice cut appears on exactly one invoice
   (billed tokens per tenant = ledger tokens per tenant, priced rows only).
3. rebuild: each finalized invoice, recomputed from the ledger and price history as of its
   cut, has the same content digest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal

from pricing.invoices import Invoice, LedgerRow, build_invoice, dedupe
from pricing.plans import TOKEN_CLASSES, PriceBook
from pricing.reconcile.metering import Report as MeteringReport


def _percent(part: int, whole: int) -> Decimal:
    if whole == 0:
        return Decimal("100.00")
    return (Decimal(100) * part / whole).quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True)
class BillingCheck:
    """Per tenant: tokens on its finalized invoices vs priced ledger tokens up to its last cut."""

    tenant_id: str
    invoices: int
    last_cut_seq: int
    ledger_tokens: int
    billed_tokens: int
    unpriced_tokens: int

    @property
    def billed_percent(self) -> Decimal:
        return _percent(self.billed_tokens, self.ledger_tokens - self.unpriced_tokens)


def check_billing(invoices: Sequence[Invoice], ledger: Iterable[LedgerRow]) -> list[BillingCheck]:
    """Every request up to a tenant's last cut, finished before its last invoiced period ended,
    is billed exactly once across that tenant's invoices."""
    by_tenant: dict[str, list[Invoice]] = {}
    for invoice in invoices:
        by_tenant.setdefault(invoice.tenant_id, []).append(invoice)
    rows = dedupe(ledger)
    checks = []
    for tenant_id in sorted(by_tenant):
        chain = sorted(by_tenant[tenant_id], key=lambda i: i.period_start)
        last = chain[-1]
        covered = [
            r
            for r in rows
            if r.tenant_id == tenant_id
            and r.stream_seq <= last.cut_seq
            and r.usage_at < last.period_end
        ]
        checks.append(
            BillingCheck(
                tenant_id=tenant_id,
                invoices=len(chain),
                last_cut_seq=last.cut_seq,
                ledger_tokens=sum(r.tokens(c) for r in covered for c in TOKEN_CLASSES),
                billed_tokens=sum(line.quantity for i in chain for line in i.lines),
                unpriced_tokens=sum(u.quantity for i in chain for u in i.unpriced),
            )
        )
    return checks


@dataclass(frozen=True)
class RebuildCheck:
    invoice_id: str
    stored_digest: str
    rebuilt_digest: str
    stored_total: Decimal
    rebuilt_total: Decimal

    @property
    def equal(self) -> bool:
        return self.stored_digest == self.rebuilt_digest


def check_rebuild(invoice: Invoice, ledger: Iterable[LedgerRow], book: PriceBook) -> RebuildCheck:
    rebuilt = build_invoice(invoice.basis, ledger, book)
    return RebuildCheck(
        invoice_id=invoice.invoice_id,
        stored_digest=invoice.content_digest,
        rebuilt_digest=rebuilt.content_digest,
        stored_total=invoice.total,
        rebuilt_total=rebuilt.total,
    )


@dataclass(frozen=True)
class ReconciliationReport:
    generated_at: datetime
    window_start: datetime
    window_end: datetime
    metering: MeteringReport
    billing: list[BillingCheck] = field(default_factory=list)
    rebuilds: list[RebuildCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.metering.mismatches
            and all(c.billed_percent == Decimal("100.00") for c in self.billing)
            and all(c.equal for c in self.rebuilds)
        )

    def as_dict(self) -> dict[str, object]:
        m = self.metering
        return {
            "generated_at": self.generated_at.isoformat(),
            "window_start": self.window_start.isoformat(),
            "window_end": self.window_end.isoformat(),
            "ok": self.ok,
            "metering": {
                "requests": m.requests,
                "matched": m.matched,
                "pending": m.pending,
                "match_percent": f"{m.match_rate * 100:.2f}",
                "billed_completion_tokens": m.billed_completion_tokens,
                "delivered_completion_tokens": m.delivered_completion_tokens,
                "generated_completion_tokens": m.generated_completion_tokens,
                "unbilled_waste_tokens": m.unbilled_waste_tokens,
                "gateway_lost": len(m.gateway_lost),
                "gateway_lost_completion_tokens": m.gateway_lost_tokens,
                "mismatches": [x.__dict__ for x in m.mismatches[:50]],
                "gateway_lost_requests": [x.__dict__ for x in m.gateway_lost[:50]],
            },
            "billing": [
                {**c.__dict__, "billed_percent": str(c.billed_percent)} for c in self.billing
            ],
            "rebuilds": [
                {
                    "invoice_id": c.invoice_id,
                    "equal": c.equal,
                    "stored_total": str(c.stored_total),
                    "rebuilt_total": str(c.rebuilt_total),
                }
                for c in self.rebuilds
            ],
        }
