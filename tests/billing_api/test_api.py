"""The billing admin API over real HTTP, on real NATS and Postgres: invoices (price change
mid-period, finalize, exports, late usage), showback CSV, capacity what-ifs, and the jobs that
`tokenmill up` schedules."""

from __future__ import annotations

import asyncio
import csv
import io
import logging
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from events.control import decode_control_or_skip
from pricing.invoices import invoice_from_json
from pricing.showback import FOCUS_COLUMNS
from tests.billing_api.conftest import Billing, at
from tests.pricing.conftest import finished

PROBLEM = "application/problem+json"


async def catalogue(b: Billing) -> tuple[str, str, str]:
    """A tenant with a cost centre and a key, a SKU whose output price doubles on Sep 15."""
    r = await b.http.post("/tenants", json={"name": "acme", "labels": {"cost_centre": "cc-42"}})
    assert r.status_code == 201, r.text
    tenant_id = r.json()["tenant_id"]
    r = await b.http.post(
        "/skus",
        json={
            "name": "qwen3.6-27b",
            "model": "Qwen/Qwen3.6-27B",
            "runtime": "tokenmill",
            "gpu_type": "H200",
        },
    )
    assert r.status_code == 201, r.text
    sku_id = r.json()["sku_id"]
    for effective_from, output in ((at(2026, 9, 1), "0.40"), (at(2026, 9, 15), "0.80")):
        r = await b.http.post(
            f"/skus/{sku_id}/price-plans",
            json={
                "input_per_mtok": "0.10",
                "cached_input_per_mtok": "0.025",
                "output_per_mtok": output,
                "currency": "USD",
                "effective_from": effective_from.isoformat(),
            },
        )
        assert r.status_code == 201, r.text
    r = await b.http.post(f"/tenants/{tenant_id}/keys", json={"name": "ci"})
    assert r.status_code == 201, r.text
    return tenant_id, sku_id, r.json()["key_id"]


async def september_usage(b: Billing, tenant_id: str, sku_id: str, key_id: str) -> None:
    """One request under each plan: 0.06 + 0.01 + 0.20 before the change, 0.20 + 0.80 after."""
    who = {"tenant_id": tenant_id, "sku_id": sku_id, "key_id": key_id}
    await b.usage(
        finished("r1", at(2026, 9, 5, 10), prompt=1_000_000, cached=400_000, completion=500_000, **who),
        finished("r2", at(2026, 9, 20, 14), prompt=2_000_000, completion=1_000_000, **who),
    )  # fmt: skip


async def test_price_change_splits_lines_finalize_once_exports_tie_out(
    billing: Billing, caplog: pytest.LogCaptureFixture
) -> None:
    b = billing
    tenant_id, sku_id, key_id = await catalogue(b)
    await september_usage(b, tenant_id, sku_id, key_id)
    september = f"/tenants/{tenant_id}/invoices/2026-09"

    r = await b.http.get(september, params={"consistent": "true"})
    assert r.status_code == 200, r.text
    draft = invoice_from_json(r.content)
    assert (draft.status, draft.total, draft.currency) == ("draft", Decimal("1.27"), "USD")
    # Each token class is billed per plan in force: one line per (class, part of the month).
    sep1, sep15, oct1 = at(2026, 9, 1), at(2026, 9, 15), at(2026, 10, 1)
    assert {
        (x.token_class, x.charge_period_start, x.charge_period_end): (x.quantity, x.unit_price_per_mtok, x.amount)
        for x in draft.lines
    } == {
        ("input", sep1, sep15): (600_000, Decimal("0.10"), Decimal("0.06")),
        ("cached_input", sep1, sep15): (400_000, Decimal("0.025"), Decimal("0.01")),
        ("output", sep1, sep15): (500_000, Decimal("0.40"), Decimal("0.20")),
        ("input", sep15, oct1): (2_000_000, Decimal("0.10"), Decimal("0.20")),
        ("output", sep15, oct1): (1_000_000, Decimal("0.80"), Decimal("0.80")),
    }  # fmt: skip
    assert len({x.plan_id for x in draft.lines}) == 2

    caplog.set_level(logging.DEBUG)
    r = await b.http.post(f"{september}/finalize")
    assert r.status_code == 201, r.text
    final = invoice_from_json(r.content)
    assert (final.status, final.total, final.lines) == ("finalized", draft.total, draft.lines)
    assert r.headers["location"] == f"/admin/v1/invoices/{final.invoice_id}"
    r = await b.http.post(f"{september}/finalize")
    assert r.status_code == 409 and r.headers["content-type"].startswith(PROBLEM)
    assert (r.json()["reason"], r.json()["invoice_id"]) == (
        "invoice_already_finalized",
        final.invoice_id,
    )

    r = await b.http.get("/invoices", params={"tenant_id": tenant_id, "consistent": "true"})
    assert r.json()["items"] == [
        {
            "invoice_id": final.invoice_id,
            "tenant_id": tenant_id,
            "period": "2026-09",
            "status": "finalized",
            "currency": "USD",
            "total": "1.27",
            "finalized_at": final.finalized_at.isoformat() if final.finalized_at else None,
            "lines": 5,
        }
    ]
    assert (await b.http.get("/invoices", params={"period": "2026-08"})).json()["items"] == []
    in_september = (await b.http.get("/invoices", params={"period": "2026-09"})).json()["items"]
    assert [i["invoice_id"] for i in in_september] == [final.invoice_id]
    by_id = await b.http.get(f"/invoices/{final.invoice_id}")
    assert invoice_from_json(by_id.content) == final
    # The view and the read models met the invoice event on the control stream: quietly.
    assert await b.services.view.sync() > 0
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert any("invoice.finalized" in rec.getMessage() for rec in caplog.records)

    r = await b.http.get(f"{september}/export", params={"format": "csv"})
    assert r.headers["content-type"].startswith("text/csv")
    assert f'filename="{final.invoice_id}.csv"' in r.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert len(rows) == 5 and {row["status"] for row in rows} == {"finalized"}
    assert sum(Decimal(row["amount"]) for row in rows) == final.total
    r = await b.http.get(f"{september}/export", params={"format": "json"})
    assert invoice_from_json(r.content) == final

    # Late usage for the closed month: an adjustment on October's draft; September stays.
    await b.usage(
        finished("late", at(2026, 9, 28), prompt=0, completion=250_000, tenant_id=tenant_id, sku_id=sku_id, key_id=key_id)
    )  # fmt: skip
    r = await b.http.get(f"/tenants/{tenant_id}/invoices/2026-10", params={"consistent": "true"})
    october = invoice_from_json(r.content)
    assert [(x.category, x.quantity, x.amount) for x in october.lines] == [
        ("adjustment", 250_000, Decimal("0.20"))
    ]
    assert invoice_from_json((await b.http.get(september)).content) == final


async def test_showback_csv_has_focus_columns_and_ties_to_the_invoice(billing: Billing) -> None:
    b = billing
    tenant_id, sku_id, key_id = await catalogue(b)
    await september_usage(b, tenant_id, sku_id, key_id)

    r = await b.http.get(
        "/showback", params={"period": "2026-09", "tenant_id": tenant_id, "consistent": "true"}
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/csv")
    records = list(csv.DictReader(io.StringIO(r.text)))
    assert tuple(records[0]) == FOCUS_COLUMNS
    invoice = invoice_from_json(
        (await b.http.get(f"/tenants/{tenant_id}/invoices/2026-09")).content
    )
    assert sum(Decimal(x["x_InvoicedCost"]) for x in records) == invoice.total == Decimal("1.27")
    assert sum(int(x["ConsumedQuantity"]) for x in records) == sum(
        x.quantity for x in invoice.lines
    )
    first = records[0]
    assert (first["BillingAccountId"], first["BillingAccountName"]) == (tenant_id, "acme")
    assert (first["SubAccountId"], first["SubAccountName"]) == (key_id, "ci")
    assert (first["SkuId"], first["ConsumedUnit"]) == (sku_id, "Tokens")
    assert first["Tags"] == '{"cost_centre":"cc-42"}'
    assert {x["ChargePeriodStart"] for x in records} == {
        "2026-09-05T00:00:00Z",
        "2026-09-20T00:00:00Z",
    }

    r = await b.http.get(
        "/showback",
        params={
            "from": "2026-09-20T00:00:00Z",
            "to": "2026-09-21T00:00:00Z",
            "granularity": "hour",
        },
    )
    hourly = list(csv.DictReader(io.StringIO(r.text)))
    assert {(x["ChargePeriodStart"], x["ChargePeriodEnd"]) for x in hourly} == {
        ("2026-09-20T14:00:00Z", "2026-09-20T15:00:00Z")
    }
    assert sum(Decimal(x["x_InvoicedCost"]) for x in hourly) == Decimal("1.00")
    assert list(csv.DictReader(io.StringIO((await b.http.get("/showback", params={"period": "2026-08"})).text))) == []  # fmt: skip

    for bad in ({}, {"period": "2026-13"}, {"period": "2026-09", "granularity": "week"}, {"from": "2026-09-02", "to": "2026-09-01"}):  # fmt: skip
        r = await b.http.get("/showback", params=bad)
        assert r.status_code == 400 and r.headers["content-type"].startswith(PROBLEM), (bad, r.text)


async def test_capacity_reference_what_if_and_measured(billing: Billing) -> None:
    b = billing
    tenant_id, sku_id, key_id = await catalogue(b)
    reference = {"tok_s": "387.6", "busy_fraction": "0.70", "gpu_hour_cost": "2.00"}

    r = await b.http.get(f"/capacity/{sku_id}", params={**reference, "consistent": "true"})
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["output_tokens_per_period"] == 703_261_440  # ~703M tokens in 30 days
    assert Decimal(p["gpu_hours_per_million_output"]).quantize(Decimal("0.001")) == Decimal("0.717")
    assert (p["cost_per_period"], p["cost_per_million_output"]) == ("1440.00", "2.0476")
    assert (p["revenue_per_million_output"], p["gpu_type"]) == ("0.8000", "H200")  # plan in force
    busier = (await b.http.get("/capacity/qwen3.6-27b", params={**reference, "busy_fraction": "0.9", "output_price": "3.00"})).json()  # fmt: skip
    assert busier["output_tokens_per_period"] > p["output_tokens_per_period"]
    assert Decimal(busier["cost_per_million_output"]) < Decimal(p["cost_per_million_output"])
    assert Decimal(busier["margin_per_million_output"]) > 0

    # Measured: 3876 output tokens in 10 busy seconds is 387.6 tok/s.
    now = datetime.now(UTC)
    await b.usage(
        finished("now", now, started=now - timedelta(seconds=10), prompt=100, completion=3876, tenant_id=tenant_id, sku_id=sku_id, key_id=key_id)
    )  # fmt: skip
    await b.http.get("/invoices", params={"consistent": "true"})
    r = await b.http.get(f"/capacity/{sku_id}", params={"gpu_hour_cost": "2.00"})
    assert r.status_code == 200, r.text
    measured = r.json()
    assert (measured["output_tokens_per_second"], measured["source"]) == ("387.6000", "ledger:w1")
    assert measured["output_tokens_per_period"] == 703_261_440

    for params, status, reason in (
        ({**reference, "busy_fraction": "1.5"}, 400, "invalid_request"),
        ({**reference, "tok_s": "fast"}, 400, "invalid_request"),
        ({**reference, "tok_s": "-1"}, 400, "invalid_request"),
        ({**reference, "days": "0"}, 400, "invalid_request"),
    ):
        r = await b.http.get(f"/capacity/{sku_id}", params=params)
        assert (r.status_code, r.json()["reason"]) == (status, reason), params
    r = await b.http.get("/capacity/nope", params=reference)
    assert (r.status_code, r.json()["reason"]) == (404, "sku_not_found")

    # No GPU-hour cost configured for H200 and none given: cost and margin are unknown.
    r = await b.http.get(f"/capacity/{sku_id}", params={"tok_s": "387.6", "output_price": "3"})
    assert r.status_code == 200, r.text
    unknown = r.json()
    assert unknown["output_tokens_per_period"] == 703_261_440
    assert (unknown["cost_per_period"], unknown["margin_fraction"]) == (None, None)
    assert "TOKENMILL_GPU_HOUR_COSTS" in unknown["unknown"]["gpu_hour_cost"]


async def test_finalize_refusals_and_auth(billing: Billing) -> None:
    b = billing
    tenant_id, sku_id, key_id = await catalogue(b)
    who = {"tenant_id": tenant_id, "sku_id": sku_id, "key_id": key_id}
    await b.usage(finished("aug", at(2026, 8, 30), **who), finished("sep", at(2026, 9, 2), **who))
    await b.http.get("/invoices", params={"consistent": "true"})
    base = f"/tenants/{tenant_id}/invoices"

    for path, status, reason in (
        (f"{base}/2026-09/finalize", 409, "earlier_period_open"),
        (f"{base}/2999-01/finalize", 409, "period_not_ended"),
        (f"{base}/2026-7/finalize", 400, "invalid_period"),
        ("/tenants/nobody/invoices/2026-08/finalize", 404, "tenant_not_found"),
    ):
        r = await b.http.post(path)
        assert (r.status_code, r.json()["reason"]) == (status, reason), (path, r.text)
    assert (await b.http.post(f"{base}/2026-08/finalize")).status_code == 201
    assert (await b.http.post(f"{base}/2026-09/finalize")).status_code == 201
    r = await b.http.post(f"{base}/2026-07/finalize")
    assert (r.status_code, r.json()["reason"]) == (409, "period_superseded")
    r = await b.http.post(f"{base}/2026-10/finalize")
    assert (r.status_code, r.json()["reason"]) == (409, "empty_period")
    r = await b.http.get("/invoices/inv_nobody_202608")
    assert (r.status_code, r.json()["reason"]) == (404, "invoice_not_found")

    r = await b.http.get("/invoices", headers={"Authorization": "Bearer wrong"})
    assert (r.status_code, r.json()["reason"]) == (401, "unauthorized")
    assert r.headers["content-type"].startswith(PROBLEM)


async def test_up_schedules_the_billing_jobs(billing: Billing) -> None:
    """`tokenmill up` enters the extension's up hooks: the jobs run at once on the leader, so
    September closes by itself and the capacity projection appears."""
    b = billing
    tenant_id, sku_id, key_id = await catalogue(b)
    await september_usage(b, tenant_id, sku_id, key_id)
    now = datetime.now(UTC)
    await b.usage(
        finished("now", now, started=now - timedelta(seconds=10), completion=3876, tenant_id=tenant_id, sku_id=sku_id, key_id=key_id)
    )  # fmt: skip
    await b.http.get("/invoices", params={"consistent": "true"})
    (hook,) = b.extension.up_hooks
    async with hook(b.services):
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            invoices = (await b.http.get("/invoices")).json()["items"]
            capacity = (await b.http.get("/capacity")).json()["items"]
            if invoices and capacity:
                break
            assert asyncio.get_running_loop().time() < deadline, (invoices, capacity)
            await asyncio.sleep(0.1)
    assert [(i["period"], i["total"]) for i in invoices] == [("2026-09", "1.27")]
    assert [(c["sku_id"], c["output_tokens_per_second"]) for c in capacity] == [
        (sku_id, "387.6000")
    ]


def test_only_foreign_event_types_are_skipped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test")
    caplog.set_level(logging.DEBUG, logger="test")
    assert decode_control_or_skip(b'{"type": "invoice.finalized", "x": 1}', 7, log, "r") is None
    assert decode_control_or_skip(b'{"type": "tenant.created"}', 8, log, "r") is None
    assert decode_control_or_skip(b"not json", 9, log, "r") is None
    assert [(rec.levelno, "seq 7" in rec.getMessage()) for rec in caplog.records] == [
        (logging.DEBUG, True),
        (logging.WARNING, False),
        (logging.WARNING, False),
    ]
