"""Cached input end to end: usage events with prompt tokens served from the prefix cache are
published to JetStream, projected into the Postgres ledger, invoiced by the period-close job
and exported as showback; ledger, invoices and exports reconcile to the cent, with cached and
uncached prompt tokens on separate lines at their own prices. A plan without a cached-input
price bills cached tokens at its input price."""

from __future__ import annotations

import csv
import io
import random
from collections import defaultdict
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from events.usage import RequestFinished
from pricing.capacity import CapacityInputs, Throughput, project
from pricing.invoices import InvoiceBasis, InvoiceLine, build_invoice, finalize, invoice_csv
from pricing.jobs import close_periods
from pricing.periods import BillingPeriod
from pricing.plans import PriceBook, PricePlan
from pricing.queries import showback_export
from pricing.showback import invoice_showback, showback_csv
from tests.pricing.conftest import BillingRig, finished, price, sku, tenant

MARCH = BillingPeriod(datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC))
CENT = Decimal("0.01")

# (input, cached input or None, output) per 1M tokens, per SKU.
PRICES: dict[str, tuple[str, str | None, str]] = {
    "qwen": ("0.50", "0.125", "3.00"),
    "llama": ("1.20", "0.30", "4.80"),
    "mixtral": ("0.70", None, "2.10"),  # no cached-input price
}
CLASSES = ("input", "cached_input", "output")


def unit_price(sku_id: str, token_class: str) -> Decimal:
    input_price, cached_price, output_price = PRICES[sku_id]
    if token_class == "input":
        return Decimal(input_price)
    if token_class == "output":
        return Decimal(output_price)
    return Decimal(cached_price if cached_price is not None else input_price)


def march_usage(skus: tuple[str, ...], seed: int) -> list[RequestFinished]:
    """Requests of two tenants over March: fully cached prompts, uncached ones and partial
    hits, with token counts that make fractions of a cent."""
    rnd = random.Random(seed)
    events = []
    for n in range(240):
        prompt = rnd.randint(1, 90_000)
        cached = (prompt, 0, rnd.randint(1, prompt))[n % 3]  # all, none, some
        events.append(
            finished(
                f"r{seed}-{n}",
                MARCH.start + timedelta(minutes=rnd.randint(0, 31 * 24 * 60 - 1)),
                tenant_id=("acme", "globex")[n % 2],
                key_id=("key-a", "key-b", "key-c")[n % 5 % 3],
                sku_id=skus[n % 7 % len(skus)],
                prompt=prompt,
                cached=cached,
                completion=rnd.randint(0, 4_000),
            )
        )
    return events


def expected_quantities(events: list[RequestFinished]) -> dict[tuple[str, str, str], int]:
    """(tenant, SKU, token class) -> tokens, from the events as published."""
    q: dict[tuple[str, str, str], int] = defaultdict(int)
    for e in events:
        q[(e.tenant_id, e.sku_id, "input")] += e.prompt_tokens - e.cached_tokens
        q[(e.tenant_id, e.sku_id, "cached_input")] += e.cached_tokens
        q[(e.tenant_id, e.sku_id, "output")] += e.completion_tokens
    return dict(q)


def cents(tokens: int, sku_id: str, token_class: str) -> Decimal:
    exact = Decimal(tokens) * unit_price(sku_id, token_class) / Decimal(1_000_000)
    return exact.quantize(CENT, rounding=ROUND_HALF_EVEN)


def exact(tokens: int, sku_id: str, token_class: str) -> Decimal:
    return Decimal(tokens) * unit_price(sku_id, token_class) / Decimal(1_000_000)


def read_csv(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode())))


async def publish(rig: BillingRig, skus: tuple[str, ...], events: list[RequestFinished]) -> None:
    await rig.control(tenant("acme"), tenant("globex"))
    for sku_id in skus:
        input_price, cached_price, output_price = PRICES[sku_id]
        assert cached_price is not None  # the control event requires one
        await rig.control(
            sku(sku_id),
            price(
                f"plan-{sku_id}",
                sku_id,
                datetime(2026, 1, 1, tzinfo=UTC),
                output=output_price,
                input=input_price,
                cached=cached_price,
            ),
        )
    await rig.usage(events)
    await rig.project()


async def assert_ledger_keeps_cached_tokens(
    rig: BillingRig, expected: dict[tuple[str, str, str], int]
) -> None:
    records = await rig.pool.fetch(
        """SELECT tenant_id, sku_id, sum(prompt_tokens - cached_tokens) AS input,
                  sum(cached_tokens) AS cached_input, sum(completion_tokens) AS output,
                  count(*) FILTER (WHERE cached_tokens = prompt_tokens) AS fully_cached,
                  count(*) FILTER (WHERE cached_tokens = 0) AS uncached
           FROM usage_ledger GROUP BY tenant_id, sku_id"""
    )
    ledger = {(r["tenant_id"], r["sku_id"], c): int(r[c]) for r in records for c in CLASSES}
    assert ledger == expected
    assert all(r["fully_cached"] > 0 and r["uncached"] > 0 for r in records)


def lines_by_class(invoice_lines: tuple[InvoiceLine, ...]) -> dict[tuple[str, str], InvoiceLine]:
    by_class = {(line.sku_id, line.token_class): line for line in invoice_lines}
    assert len(by_class) == len(invoice_lines)  # one line per SKU x class: cached apart
    return by_class


async def test_cached_tokens_bill_at_the_cached_price_and_reconcile_to_the_cent(
    rig: BillingRig,
) -> None:
    skus = ("qwen", "llama")
    events = march_usage(skus, seed=7)
    await publish(rig, skus, events)
    expected = expected_quantities(events)
    await assert_ledger_keeps_cached_tokens(rig, expected)

    closed = await close_periods(rig.ctx, now=datetime(2026, 4, 1, 2, tzinfo=UTC))
    invoices = {i.tenant_id: i for i in closed}
    assert sorted(invoices) == ["acme", "globex"]
    assert {i.tenant_id: i for i in await rig.store.invoices()} == invoices

    for tenant_id, invoice in invoices.items():
        lines = lines_by_class(invoice.lines)
        assert set(lines) == {(s, c) for s in skus for c in CLASSES}
        for (sku_id, token_class), line in lines.items():
            quantity = expected[(tenant_id, sku_id, token_class)]
            assert line.quantity == quantity
            assert line.unit_price_per_mtok == unit_price(sku_id, token_class)
            assert line.amount == cents(quantity, sku_id, token_class)
        assert invoice.total == sum(
            (cents(expected[(tenant_id, s, c)], s, c) for s in skus for c in CLASSES), Decimal(0)
        )
        # cached input priced as input would cost more: the cached price really applied
        cached_at_input = sum(
            cents(expected[(tenant_id, s, "cached_input")], s, "input") for s in skus
        )
        cached_billed = sum(lines[(s, "cached_input")].amount for s in skus)
        assert cached_billed < cached_at_input

        exported = read_csv(invoice_csv(invoice))
        assert sum(Decimal(r["amount"]) for r in exported) == invoice.total
        assert {(r["sku_id"], r["token_class"]) for r in exported} == set(lines)

    showback = read_csv(await showback_export(rig.store, MARCH.start, MARCH.end, "day"))
    billed: dict[tuple[str, str, str], Decimal] = defaultdict(Decimal)
    invoiced: dict[tuple[str, str, str], Decimal] = defaultdict(Decimal)
    consumed: dict[tuple[str, str, str], int] = defaultdict(int)
    for r in showback:
        key = (r["BillingAccountId"], r["SkuId"], r["x_TokenClass"])
        assert Decimal(r["ListUnitPrice"]) == unit_price(key[1], key[2])
        assert r["x_Unpriced"] == "false"
        billed[key] += Decimal(r["BilledCost"])
        invoiced[key] += Decimal(r["x_InvoicedCost"])
        consumed[key] += int(r["ConsumedQuantity"])
    assert dict(consumed) == {k: v for k, v in expected.items() if v}
    for key, quantity in consumed.items():
        assert billed[key] == exact(quantity, key[1], key[2])  # full precision, no rounding
        assert invoiced[key] == cents(quantity, key[1], key[2])  # the invoice line's amount
    for tenant_id, invoice in invoices.items():
        assert sum(v for k, v in invoiced.items() if k[0] == tenant_id) == invoice.total


async def test_a_plan_without_a_cached_price_bills_cached_tokens_at_the_input_price(
    rig: BillingRig,
) -> None:
    skus = ("qwen", "mixtral")
    events = march_usage(skus, seed=11)
    await publish(rig, ("qwen",), events)
    expected = expected_quantities(events)
    await assert_ledger_keeps_cached_tokens(rig, expected)

    # The admin API and its control event require a cached price; the pricing model takes a
    # plan without one, as a plan of the price book here.
    input_price, _, output_price = PRICES["mixtral"]
    no_cached = PricePlan(
        plan_id="plan-mixtral",
        sku_id="mixtral",
        currency="USD",
        input_per_mtok=Decimal(input_price),
        output_per_mtok=Decimal(output_price),
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    )
    book = PriceBook([*(await rig.store.price_book()).plans, no_cached])
    cut = await rig.store.ledger_position()
    for tenant_id in ("acme", "globex"):
        basis = InvoiceBasis(tenant_id=tenant_id, period=MARCH, currency="USD", cut_seq=cut)
        rows = await rig.store.invoice_rows(basis)
        invoice = finalize(build_invoice(basis, rows, book), datetime(2026, 4, 1, tzinfo=UTC))
        lines = lines_by_class(invoice.lines)
        cached = lines[("mixtral", "cached_input")]
        uncached = lines[("mixtral", "input")]
        assert cached.unit_price_per_mtok == uncached.unit_price_per_mtok == Decimal("0.70")
        assert cached.quantity == expected[(tenant_id, "mixtral", "cached_input")]
        assert cached.amount == cents(cached.quantity, "mixtral", "input")
        assert "no cached-input price" in cached.description
        assert lines[("qwen", "cached_input")].unit_price_per_mtok == Decimal("0.125")
        assert invoice.total == sum(
            (cents(expected[(tenant_id, s, c)], s, c) for s in skus for c in CLASSES), Decimal(0)
        )

        records = read_csv(showback_csv(invoice_showback(invoice.basis, rows, book)))
        mixtral_cached = [
            r for r in records if r["SkuId"] == "mixtral" and r["x_TokenClass"] == "cached_input"
        ]
        assert mixtral_cached and all(r["ListUnitPrice"] == "0.70" for r in mixtral_cached)
        assert sum(int(r["ConsumedQuantity"]) for r in mixtral_cached) == cached.quantity
        assert sum(Decimal(r["x_InvoicedCost"]) for r in mixtral_cached) == cached.amount
        assert sum(Decimal(r["x_InvoicedCost"]) for r in records) == invoice.total


def test_capacity_prices_cached_input_of_a_plan_without_a_cached_price_as_input() -> None:
    plan = PricePlan(
        plan_id="p",
        sku_id="mixtral",
        currency="USD",
        input_per_mtok=Decimal("0.50"),
        output_per_mtok=Decimal("3.00"),
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    )
    inputs = CapacityInputs(
        gpu_hour_cost=Decimal("2.00"),
        input_tokens_per_output_token=Decimal(2),
        cached_share_of_input=Decimal("0.5"),
    )
    throughput = Throughput(sku_id="mixtral", output_tokens_per_second=Decimal("100"))
    priced = project(throughput, inputs.priced_by(plan))
    assert priced.revenue_per_million_output == Decimal("4.00")  # 3 + 1 x 0.50 + 1 x 0.50
    # a what-if with an input price and no cached price earns the same
    what_if = project(
        throughput, replace(inputs, input_price=Decimal("0.50"), output_price=Decimal("3.00"))
    )
    assert what_if.revenue_per_million_output == Decimal("4.00")
