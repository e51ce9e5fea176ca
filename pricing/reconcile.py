"""Reconciliation: does what was billed equal what was served, and do invoices still rebuild?

Three checks, each a pure function of ledger-side inputs:
1. metering: the worker's RequestFinished (the ledger) against the gateway's GatewayDelivered
   per request id: both present and token counts equal -> matched. The gateway records what it
   relayed; after a worker was given up on, the worker's own late event may bill a few tokens
   more (the gateway explains this), so mismatches are listed by request for an operator.
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

import msgspec

from pricing.invoices import Invoice, LedgerRow, build_invoice, dedupe
from pricing.plans import TOKEN_CLASSES, PriceBook


class DeliveryRow(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway relayed for one request (events.usage.GatewayDelivered)."""

    request_id: str
    tenant_id: str
    key_id: str
    sku_id: str
    gateway_id: str = ""
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    client_disconnected: bool = False
    finished_at: datetime
    stream_seq: int = 0


@dataclass(frozen=True)
class Mismatch:
    request_id: str
    tenant_id: str
    billed_prompt: int | None  # None: no ledger row
    billed_completion: int | None
    delivered_prompt: int | None  # None: no gateway record
    delivered_completion: int | None


def _percent(part: int, whole: int) -> Decimal:
    if whole == 0:
        return Decimal("100.00")
    return (Decimal(100) * part / whole).quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True)
class MeteringCheck:
    requests: int  # request ids seen on either side
    matched: int
    ledger_only: int
    gateway_only: int
    token_mismatches: int
    billed_completion_tokens: int
    delivered_completion_tokens: int
    cancelled_requests: int
    mismatches: tuple[Mismatch, ...] = ()  # the first few, for a human

    @property
    def match_percent(self) -> Decimal:
        return _percent(self.matched, self.requests)


def check_metering(
    ledger: Iterable[LedgerRow], deliveries: Iterable[DeliveryRow], keep: int = 50
) -> MeteringCheck:
    billed = {r.request_id: r for r in dedupe(ledger)}
    delivered: dict[str, DeliveryRow] = {}
    for delivery in deliveries:
        delivered.setdefault(delivery.request_id, delivery)
    matched = ledger_only = gateway_only = token_mismatches = 0
    mismatches: list[Mismatch] = []
    for request_id in sorted(billed.keys() | delivered.keys()):
        b, d = billed.get(request_id), delivered.get(request_id)  # either may be missing
        if b is not None and d is not None:
            if (b.prompt_tokens, b.completion_tokens) == (d.prompt_tokens, d.completion_tokens):
                matched += 1
                continue
            token_mismatches += 1
        elif b is not None:
            ledger_only += 1
        else:
            gateway_only += 1
        if len(mismatches) < keep:
            either = b or d
            assert either is not None
            mismatches.append(
                Mismatch(
                    request_id=request_id,
                    tenant_id=either.tenant_id,
                    billed_prompt=b.prompt_tokens if b else None,
                    billed_completion=b.completion_tokens if b else None,
                    delivered_prompt=d.prompt_tokens if d else None,
                    delivered_completion=d.completion_tokens if d else None,
                )
            )
    return MeteringCheck(
        requests=len(billed.keys() | delivered.keys()),
        matched=matched,
        ledger_only=ledger_only,
        gateway_only=gateway_only,
        token_mismatches=token_mismatches,
        billed_completion_tokens=sum(r.completion_tokens for r in billed.values()),
        delivered_completion_tokens=sum(d.completion_tokens for d in delivered.values()),
        cancelled_requests=sum(1 for r in billed.values() if r.finish_reason == "cancelled"),
        mismatches=tuple(mismatches),
    )


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
    metering: MeteringCheck
    billing: list[BillingCheck] = field(default_factory=list)
    rebuilds: list[RebuildCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.metering.match_percent == Decimal("100.00")
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
                "match_percent": str(m.match_percent),
                "ledger_only": m.ledger_only,
                "gateway_only": m.gateway_only,
                "token_mismatches": m.token_mismatches,
                "billed_completion_tokens": m.billed_completion_tokens,
                "delivered_completion_tokens": m.delivered_completion_tokens,
                "cancelled_requests": m.cancelled_requests,
                "mismatches": [x.__dict__ for x in m.mismatches],
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
