import csv
import io
import random
from collections import defaultdict
from datetime import timedelta
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from pricing.invoices import (
    CurrencyMismatch,
    InvoiceAlreadyFinalized,
    InvoiceBasis,
    LedgerRow,
    PreviousInvoice,
    build_invoice,
    finalize,
    invoice_csv,
    invoice_from_json,
    invoice_json,
    next_basis,
)
from pricing.money import line_amount
from pricing.periods import BillingPeriod
from pricing.plans import TOKEN_CLASSES, PriceBook, PricePlan
from tests.pricing.factories import at, plan, row

MARCH = BillingPeriod.month(2026, 3)
PLANS = [
    plan("p-jan", at(2026, 1, 1), input="0.50", cached="0.25", output="3.00"),
    plan("p-mid-march", at(2026, 3, 16), input="0.40", cached="0.10", output="2.40"),
]


def march_basis(cut: int = 10**9) -> InvoiceBasis:
    return InvoiceBasis(tenant_id="acme", period=MARCH, currency="USD", cut_seq=cut)


def ledger_times_prices(rows: list[LedgerRow], plans: list[PricePlan]) -> Decimal:
    """The expected total, computed independently of pricing.invoices' grouping: sum the
    tokens per (plan, class) straight from the rows, then round each sum once."""
    book = PriceBook(plans)
    quantities: dict[tuple[str, str], int] = defaultdict(int)
    prices = {}
    for r in rows:
        p = book.in_force(r.sku_id, r.finished_at)
        assert p is not None
        input_tokens = r.prompt_tokens - r.cached_tokens
        for token_class, q in zip(
            TOKEN_CLASSES, (input_tokens, r.cached_tokens, r.completion_tokens), strict=True
        ):
            quantities[(p.plan_id, token_class)] += q
            prices[(p.plan_id, token_class)] = p.unit_price(token_class)
    return sum((line_amount(q, prices[k], "USD") for k, q in quantities.items()), Decimal("0.00"))


def test_price_change_mid_period_splits_line_items() -> None:
    rows = [
        row(at(2026, 3, 2, 10), prompt=1_000_000, cached=200_000, completion=500_000),
        row(at(2026, 3, 15, 23, 59), prompt=2_000_000, cached=0, completion=1_000_000),
        row(at(2026, 3, 16, 0, 0), prompt=3_000_000, cached=1_000_000, completion=250_000),
        row(at(2026, 3, 31, 23, 59, 59), prompt=1, cached=0, completion=1),
        row(at(2026, 4, 1), prompt=9_000_000, completion=9_000_000),  # April: not in March
        row(at(2026, 3, 5), tenant_id="other"),  # another tenant
    ]
    invoice = build_invoice(march_basis(), rows, PLANS)
    lines = {(ln.plan_id, ln.token_class): ln for ln in invoice.lines}
    assert set(lines) == {
        ("p-jan", "input"),
        ("p-jan", "cached_input"),
        ("p-jan", "output"),
        ("p-mid-march", "input"),
        ("p-mid-march", "cached_input"),
        ("p-mid-march", "output"),
    }
    old_input, new_input = lines[("p-jan", "input")], lines[("p-mid-march", "input")]
    assert old_input.quantity == 800_000 + 2_000_000 and old_input.requests == 2
    assert old_input.amount == Decimal("1.40")  # 2.8M x 0.50
    assert (old_input.charge_period_start, old_input.charge_period_end) == (
        at(2026, 3, 1),
        at(2026, 3, 16),
    )
    assert new_input.quantity == 2_000_001 and new_input.amount == Decimal(
        "0.80"
    )  # 2.000001M x 0.40
    assert (new_input.charge_period_start, new_input.charge_period_end) == (
        at(2026, 3, 16),
        at(2026, 4, 1),
    )
    assert lines[("p-jan", "output")].amount == Decimal("4.50")  # 1.5M x 3.00
    assert lines[("p-mid-march", "output")].amount == Decimal(
        "0.60"
    )  # 0.250001M x 2.40 = 0.6000024
    assert lines[("p-mid-march", "cached_input")].amount == Decimal("0.10")
    assert invoice.total == invoice.usage_total == sum(ln.amount for ln in invoice.lines)
    assert invoice.adjustments_total == Decimal("0.00")
    # Lines are in canonical order: SKU, token class, then plan start.
    assert [(ln.token_class, ln.plan_id) for ln in invoice.lines] == [
        ("input", "p-jan"),
        ("input", "p-mid-march"),
        ("cached_input", "p-jan"),
        ("cached_input", "p-mid-march"),
        ("output", "p-jan"),
        ("output", "p-mid-march"),
    ]


def random_rows(seed: int, n: int, period: BillingPeriod = MARCH) -> list[LedgerRow]:
    rng = random.Random(seed)
    span = int((period.end - period.start).total_seconds())
    rows = []
    for i in range(n):
        prompt = rng.randint(1, 8000)
        rows.append(
            row(
                period.start + timedelta(seconds=rng.randrange(span)),
                seq=i + 1,
                key_id=rng.choice(["key-1", "key-2", "key-3"]),
                model=rng.choice(["qwen3.6-27b", "qwen3.6-27b-fp8"]),
                prompt=prompt,
                cached=rng.randint(0, prompt),
                completion=rng.randint(0, 512),
                finish_reason=rng.choice(["stop", "length", "cancelled"]),
            )
        )
    return rows


def test_csv_total_equals_invoice_total_equals_ledger_times_prices() -> None:
    rows = random_rows(7, 2000)
    invoice = build_invoice(march_basis(), rows, PLANS)
    records = list(csv.DictReader(io.StringIO(invoice_csv(invoice).decode())))
    assert len(records) == len(invoice.lines) == 6
    assert sum(Decimal(r["amount"]) for r in records) == invoice.total
    assert invoice.total == ledger_times_prices(rows, PLANS)
    assert sum(int(r["quantity"]) for r in records) == sum(
        r.prompt_tokens + r.completion_tokens for r in rows
    )


def test_same_inputs_give_the_same_bytes_in_any_order() -> None:
    rows = random_rows(11, 500)
    first = build_invoice(march_basis(), rows, PLANS)
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    second = build_invoice(march_basis(), shuffled, list(reversed(PLANS)))
    assert invoice_json(first) == invoice_json(second)
    assert invoice_csv(first) == invoice_csv(second)
    assert first.content_digest == second.content_digest
    assert invoice_from_json(invoice_json(first)) == first


def test_late_usage_becomes_an_adjustment_on_the_next_invoice() -> None:
    on_time = [row(at(2026, 3, d), seq=d, completion=1_000_000) for d in range(1, 31)]
    march = finalize(build_invoice(march_basis(cut=30), on_time, PLANS), at(2026, 4, 2))
    assert march.status == "finalized" and march.finalized_at == at(2026, 4, 2)
    march_bytes = invoice_json(march)

    # Usage from March 20 arrives after March was closed at seq 30; April usage arrives too.
    late = row(at(2026, 3, 20), seq=31, prompt=0, completion=500_000)
    early_april = row(
        at(2026, 4, 1, 0, 0, 1), seq=25, prompt=0, completion=1_000_000
    )  # before the cut
    april_usage = row(at(2026, 4, 3), seq=32, prompt=0, completion=1_000_000)
    ledger = [*on_time, late, early_april, april_usage]

    # Rebuilding March as of its cut gives the same invoice: the late row is not in it.
    assert build_invoice(march.basis, ledger, PLANS).content_digest == march.content_digest
    with pytest.raises(InvoiceAlreadyFinalized):
        finalize(march, at(2026, 4, 3))
    assert invoice_json(march) == march_bytes

    april = build_invoice(next_basis(march, cut_seq=40), ledger, PLANS)
    adjustments = [ln for ln in april.lines if ln.category == "adjustment"]
    assert len(adjustments) == 1
    adjustment = adjustments[0]
    assert (adjustment.token_class, adjustment.quantity, adjustment.plan_id) == (
        "output",
        500_000,
        "p-mid-march",
    )
    assert adjustment.amount == Decimal("1.20")  # at March 20's price, 2.40/1M
    assert (adjustment.charge_period_start, adjustment.charge_period_end) == (
        at(2026, 3, 16),
        at(2026, 4, 1),
    )
    assert adjustment.description.startswith("Late usage from 2026-03")
    usage = [ln for ln in april.lines if ln.category == "usage"]
    assert [ln.quantity for ln in usage] == [2_000_000]  # both April rows, whatever their seq
    assert april.adjustments_total == Decimal("1.20")
    assert april.total == april.usage_total + april.adjustments_total == Decimal("6.00")
    # May, built later, does not bill the late row again.
    may = build_invoice(next_basis(april, cut_seq=50), ledger, PLANS)
    assert may.lines == () and may.total == Decimal("0.00")


def test_a_gap_in_the_invoice_chain_loses_no_usage() -> None:
    january = BillingPeriod.month(2026, 1)
    jan_rows = [row(at(2026, 1, 10), seq=1)]
    feb_row = row(at(2026, 2, 1, 0, 1), seq=2)  # February usage recorded before January closed
    jan = finalize(
        build_invoice(
            InvoiceBasis(tenant_id="acme", period=january, currency="USD", cut_seq=2),
            jan_rows,
            PLANS,
        ),
        at(2026, 2, 3),
    )
    # No February invoice was issued for this tenant; March's invoice follows January's.
    basis = InvoiceBasis(
        tenant_id="acme",
        period=MARCH,
        currency="USD",
        cut_seq=5,
        previous=PreviousInvoice(jan.period_end, jan.cut_seq),
    )
    march = build_invoice(basis, [*jan_rows, feb_row], PLANS)
    assert [(ln.category, ln.quantity) for ln in march.lines if ln.token_class == "input"] == [
        ("adjustment", 1000)
    ]


def test_cancelled_requests_bill_the_tokens_they_used_and_zero_classes_add_no_lines() -> None:
    rows = [
        row(at(2026, 3, 3), prompt=4000, cached=4000, completion=0, finish_reason="cancelled"),
        row(at(2026, 3, 3), prompt=100, completion=7, finish_reason="cancelled"),
    ]
    invoice = build_invoice(march_basis(), rows, PLANS)
    assert {(ln.token_class, ln.quantity, ln.requests) for ln in invoice.lines} == {
        ("cached_input", 4000, 1),
        ("input", 100, 1),
        ("output", 7, 1),
    }


def test_unpriced_usage_is_listed_not_billed_and_currencies_do_not_mix() -> None:
    rows = [row(at(2026, 3, 3), sku_id="llama-8b"), row(at(2026, 3, 3))]
    invoice = build_invoice(march_basis(), rows, PLANS)
    assert {(u.sku_id, u.token_class, u.quantity) for u in invoice.unpriced} == {
        ("llama-8b", "input", 1000),
        ("llama-8b", "output", 200),
    }
    assert {ln.sku_id for ln in invoice.lines} == {"qwen-27b"}
    euro = [plan("p-eur", at(2026, 1, 1), currency="EUR")]
    with pytest.raises(CurrencyMismatch):
        build_invoice(march_basis(), rows[1:], euro)


def test_duplicate_request_rows_bill_once() -> None:
    first = row(at(2026, 3, 3), seq=5, request_id="dup")
    again = row(at(2026, 3, 3), seq=9, request_id="dup")
    invoice = build_invoice(march_basis(), [again, first], PLANS)
    assert sum(ln.requests for ln in invoice.lines if ln.token_class == "output") == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=5 * 24 * 3600 - 1),  # offset into a 5-day window
            st.integers(min_value=0, max_value=3 * 24 * 3600),  # delay until it reaches the stream
            st.integers(min_value=0, max_value=5000),
            st.integers(min_value=0, max_value=5000),
        ),
        max_size=60,
    ),
    st.integers(min_value=0, max_value=2 * 24 * 3600),  # grace before each period closes
)
def test_every_request_is_billed_exactly_once_across_a_chain_of_invoices(
    events: list[tuple[int, int, int, int]], grace: int
) -> None:
    """Daily periods closed after a grace window: arrivals in stream order, each period's cut
    = the last sequence received by its close. Every row lands on exactly one invoice."""
    start = at(2026, 3, 14)  # spans the mid-March price change
    arrivals = sorted(events, key=lambda e: (e[0] + e[1], e[0]))
    rows = [
        row(start + timedelta(seconds=offset), seq=i + 1, prompt=p, completion=c)
        for i, (offset, _, p, c) in enumerate(arrivals)
    ]
    received = [start + timedelta(seconds=o + d) for o, d, _, _ in arrivals]
    period = BillingPeriod(start, start + timedelta(days=1))
    invoices = []
    previous = None
    for _ in range(9):  # 5 days of usage + 3 days of delays + 1
        close = period.end + timedelta(seconds=grace)
        cut = max([i + 1 for i, t in enumerate(received) if t <= close], default=0)
        if previous is not None:
            cut = max(cut, previous.cut_seq)
        basis = InvoiceBasis(tenant_id="acme", period=period, currency="USD", cut_seq=cut)
        if previous is not None:
            basis = next_basis(previous, cut)
        previous = finalize(build_invoice(basis, rows, PLANS), close)
        invoices.append(previous)
        period = period.following()
    billed = sum(ln.quantity for inv in invoices for ln in inv.lines)
    assert billed == sum(r.prompt_tokens + r.completion_tokens for r in rows)
    output_requests = sum(
        ln.requests for inv in invoices for ln in inv.lines if ln.token_class == "output"
    )
    assert output_requests == sum(1 for r in rows if r.completion_tokens > 0)


def test_a_rebuild_prices_with_the_plans_known_at_the_cut() -> None:
    rows = random_rows(21, 200)
    known = [replace(p, recorded_seq=i + 1) for i, p in enumerate(PLANS)]
    basis = InvoiceBasis(
        tenant_id="acme", period=MARCH, currency="USD", cut_seq=10**9, price_cut_seq=2
    )
    original = finalize(build_invoice(basis, rows, known), at(2026, 4, 2))
    # A plan recorded later, even one claiming to start in the past, does not change the rebuild.
    retro = replace(plan("p-retro", at(2026, 3, 1), output="9.99"), recorded_seq=3)
    rebuilt = build_invoice(original.basis, rows, [*known, retro])
    assert rebuilt.content_digest == original.content_digest
    assert build_invoice(march_basis(), rows, [*known, retro]).total != original.total


def test_invoice_csv_lists_unpriced_usage_flagged_at_no_cost() -> None:
    rows = [row(at(2026, 3, 3), sku_id="llama-8b"), row(at(2026, 3, 3))]
    invoice = build_invoice(march_basis(), rows, PLANS)
    records = list(csv.DictReader(io.StringIO(invoice_csv(invoice).decode())))
    unpriced = [r for r in records if r["unpriced"] == "true"]
    assert {(r["sku_id"], r["token_class"], r["quantity"]) for r in unpriced} == {
        ("llama-8b", "input", "1000"),
        ("llama-8b", "output", "200"),
    }
    assert {(r["amount"], r["plan_id"], r["unit_price_per_mtok"]) for r in unpriced} == {
        ("0.00", "", "")
    }
    assert all("no price plan" in r["description"] for r in unpriced)
    priced = [r for r in records if r["unpriced"] == "false"]
    assert {r["sku_id"] for r in priced} == {"qwen-27b"}
    assert sum(Decimal(r["amount"]) for r in records) == invoice.total
    assert [r["line"] for r in records] == [str(n) for n in range(1, len(records) + 1)]
