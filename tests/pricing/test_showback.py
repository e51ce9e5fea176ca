import csv
import io
import json
from decimal import Decimal

from pricing.invoices import build_invoice, finalize, next_basis
from pricing.money import exact_cost, exact_sum
from pricing.periods import BillingPeriod
from pricing.plans import PriceBook
from pricing.showback import (
    FOCUS_COLUMNS,
    Attribution,
    invoice_showback,
    showback_csv,
    usage_showback,
)
from tests.pricing.factories import at, row
from tests.pricing.test_invoices import MARCH, PLANS, ledger_times_prices, march_basis, random_rows

BOOK = PriceBook(PLANS)
ATTRIBUTION = Attribution(
    tenant_names={"acme": "Acme Corp"},
    tenant_labels={"acme": {"cost_centre": "CC-1042", "team": "research"}},
    key_labels={"key-2": {"team": "search"}},
)


def read(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode())))


def test_hourly_csv_total_equals_invoice_total_equals_ledger_times_prices() -> None:
    rows = random_rows(5, 3000)
    invoice = build_invoice(march_basis(), rows, PLANS)
    for granularity in ("hour", "day"):
        records = usage_showback(rows, BOOK, MARCH.start, MARCH.end, granularity)
        table = read(showback_csv(records, ATTRIBUTION))
        # Thousands of sub-cent cells: naive per-cell rounding would drift; allocation does not.
        assert len(table) > 1000 if granularity == "hour" else len(table) > 100
        assert sum(Decimal(r["x_InvoicedCost"]) for r in table) == invoice.total
        # The exact costs add up to the unrounded cost of the lines.
        exact = sum(Decimal(r["BilledCost"]) for r in table)
        assert exact == sum(Decimal(r["EffectiveCost"]) for r in table)
        assert exact == exact_sum(
            exact_cost(ln.quantity, ln.unit_price_per_mtok) for ln in invoice.lines
        )
        assert abs(exact - invoice.total) <= Decimal("0.005") * len(invoice.lines)
        assert invoice.total == ledger_times_prices(rows, PLANS)
        assert sum(int(r["ConsumedQuantity"]) for r in table) == sum(
            ln.quantity for ln in invoice.lines
        )
        assert sum(int(r["x_Requests"]) for r in table if r["x_TokenClass"] == "output") == sum(
            1 for r in rows if r.completion_tokens
        )


def test_focus_columns_and_tenant_labels() -> None:
    rows = [
        row(at(2026, 3, 16, 9, 30), key_id="key-2", prompt=2_000_000, completion=1_000_000),
        row(at(2026, 3, 16, 9, 45), key_id="key-1", prompt=0, completion=500_000),
    ]
    table = read(
        showback_csv(usage_showback(rows, BOOK, MARCH.start, MARCH.end, "hour"), ATTRIBUTION)
    )
    assert tuple(table[0]) == FOCUS_COLUMNS
    by_key_class = {(r["SubAccountId"], r["x_TokenClass"]): r for r in table}
    assert set(by_key_class) == {("key-2", "input"), ("key-2", "output"), ("key-1", "output")}
    out = by_key_class[("key-2", "output")]
    assert out["BillingAccountId"] == "acme" and out["BillingAccountName"] == "Acme Corp"
    assert out["BilledCost"] == "2.40" and out["ListUnitPrice"] == "2.40"
    assert out["ConsumedQuantity"] == "1000000" and out["ConsumedUnit"] == "Tokens"
    assert out["PricingQuantity"] == "1" and out["PricingUnit"] == "1M Tokens"
    assert out["ChargePeriodStart"] == "2026-03-16T09:00:00Z"
    assert out["ChargePeriodEnd"] == "2026-03-16T10:00:00Z"
    assert out["BillingPeriodStart"] == "2026-03-01T00:00:00Z"
    assert out["ChargeCategory"] == "Usage" and out["ChargeClass"] == ""
    assert out["SkuId"] == "qwen-27b" and out["SkuPriceId"] == "p-mid-march"
    assert out["ResourceId"] == "qwen3.6-27b" and out["BillingCurrency"] == "USD"
    assert json.loads(out["Tags"]) == {"cost_centre": "CC-1042", "team": "search"}
    assert json.loads(by_key_class[("key-1", "output")]["Tags"]) == {
        "cost_centre": "CC-1042",
        "team": "research",
    }


def test_invoice_showback_ties_to_the_invoice_including_late_usage() -> None:
    march_rows = random_rows(9, 400)
    cut = max(r.stream_seq for r in march_rows)
    march = finalize(build_invoice(march_basis(cut), march_rows, PLANS), at(2026, 4, 2))
    late = [row(at(2026, 3, 31, 23), seq=cut + 1, key_id="key-9", completion=123_457)]
    april_rows = [row(at(2026, 4, 2, 8), seq=cut + 2)]
    ledger = [*march_rows, *late, *april_rows]
    april_basis = next_basis(march, cut + 10)
    april = build_invoice(april_basis, ledger, PLANS)
    table = read(showback_csv(invoice_showback(april_basis, ledger, BOOK, "day"), ATTRIBUTION))
    assert sum(Decimal(r["x_InvoicedCost"]) for r in table) == april.total
    corrections = [r for r in table if r["ChargeClass"] == "Correction"]
    assert {r["SubAccountId"] for r in corrections} == {"key-9"}
    assert all(r["BillingPeriodStart"] == "2026-04-01T00:00:00Z" for r in table)
    assert {r["ChargePeriodStart"] for r in corrections} == {"2026-03-31T00:00:00Z"}
    march_table = read(showback_csv(invoice_showback(march.basis, ledger, BOOK, "hour")))
    assert sum(Decimal(r["x_InvoicedCost"]) for r in march_table) == march.total


def test_showback_is_deterministic() -> None:
    rows = random_rows(13, 300)
    first = showback_csv(usage_showback(rows, BOOK, MARCH.start, MARCH.end, "hour"), ATTRIBUTION)
    second = showback_csv(
        usage_showback(rows[::-1], BOOK, MARCH.start, MARCH.end, "hour"), ATTRIBUTION
    )
    assert first == second


def test_showback_window_and_cut() -> None:
    rows = [
        row(at(2026, 3, 1, 5), seq=1),
        row(at(2026, 3, 2, 5), seq=2),
        row(at(2026, 3, 1, 6), seq=3),
    ]
    day_one = usage_showback(rows, BOOK, at(2026, 3, 1), at(2026, 3, 2), "day")
    assert sum(r.requests for r in day_one if r.token_class == "output") == 2
    as_of = usage_showback(rows, BOOK, at(2026, 3, 1), at(2026, 3, 2), "day", cut_seq=2)
    assert sum(r.requests for r in as_of if r.token_class == "output") == 1
    assert BillingPeriod.containing(day_one[0].charge_period_start) == MARCH


def test_sub_cent_costs_keep_their_precision_and_invoiced_cost_ties_out() -> None:
    # 7 output tokens per key at 3.00/1M: 0.000021 each, 0.00 once rounded to the cent.
    rows = [row(at(2026, 3, 3, h), key_id=f"key-{h}", prompt=0, completion=7) for h in range(3)]
    invoice = build_invoice(march_basis(), rows, PLANS)
    table = read(showback_csv(usage_showback(rows, BOOK, MARCH.start, MARCH.end, "day")))
    assert [r["BilledCost"] for r in table] == ["0.000021"] * 3
    assert {r["EffectiveCost"] for r in table} == {r["ListCost"] for r in table} == {"0.000021"}
    assert sum(Decimal(r["BilledCost"]) for r in table) == Decimal("0.000063")
    # What the invoice bills, rounded once per line and allocated: ties to its total.
    assert sum(Decimal(r["x_InvoicedCost"]) for r in table) == invoice.total == Decimal("0.00")


def test_unpriced_usage_appears_flagged_in_the_showback() -> None:
    rows = [
        row(at(2026, 3, 3, 9), sku_id="llama-8b", key_id="key-2", model="llama"),
        row(at(2026, 3, 3, 9)),
    ]
    for records in (
        usage_showback(rows, BOOK, MARCH.start, MARCH.end, "day"),
        invoice_showback(march_basis(), rows, BOOK),
    ):
        table = read(showback_csv(records, ATTRIBUTION))
        unpriced = [r for r in table if r["x_Unpriced"] == "true"]
        assert {(r["SkuId"], r["x_TokenClass"], r["ConsumedQuantity"]) for r in unpriced} == {
            ("llama-8b", "input", "1000"),
            ("llama-8b", "output", "200"),
        }
        for r in unpriced:
            assert (r["BilledCost"], r["x_InvoicedCost"], r["SkuPriceId"]) == ("0", "0.00", "")
            assert (r["ListUnitPrice"], r["BillingCurrency"]) == ("", "USD")
            assert (r["SubAccountId"], r["ResourceId"]) == ("key-2", "llama")
            assert "no price plan" in r["ChargeDescription"]
        assert {r["SkuId"] for r in table if r["x_Unpriced"] == "false"} == {"qwen-27b"}
