"""The billing jobs against real NATS and Postgres: period close, adjustments, rebuilds,
rollups, capacity, reconciliation of a 10,000-request run, and the leader lock."""

from __future__ import annotations

import asyncio
import csv
import io
import random
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from events.projections import Projector
from events.usage import GatewayDelivered, RequestFinished
from pricing.capacity import throughput_from_busy, throughput_from_ledger
from pricing.events import read_finalized
from pricing.invoices import invoice_json
from pricing.jobs import (
    BillingScheduler,
    LeaderLock,
    close_periods,
    reconcile,
    refresh_capacity,
    refresh_rollups,
)
from pricing.showback import invoice_showback, showback_csv
from pricing.store import InvoicesProjection
from tests.pricing.conftest import BillingRig, delivered, finished, price, sku, tenant


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


async def setup_catalogue(rig: BillingRig) -> None:
    await rig.control(
        tenant("acme", cost_centre="CC-1042"),
        tenant("globex"),
        sku("qwen"),
        price("p1", "qwen", at(2026, 1, 1), output="3.00"),
        price("p2", "qwen", at(2026, 3, 16), output="2.40", input="0.40"),
    )


async def test_close_finalizes_once_and_late_usage_adjusts_the_next_invoice(
    rig: BillingRig,
) -> None:
    await setup_catalogue(rig)
    march = [
        finished("r1", at(2026, 3, 2), completion=1_000_000, prompt=2_000_000),
        finished("r2", at(2026, 3, 15, 23, 59), completion=500_000),
        finished("r3", at(2026, 3, 20), completion=1_000_000, prompt=1_000_000, cached=400_000),
        finished("g1", at(2026, 3, 21), tenant_id="globex", completion=10),
    ]
    april_early = finished("r4", at(2026, 4, 1, 0, 30), completion=1_000_000, prompt=0)
    await rig.usage([*march, april_early, *(delivered(e) for e in [*march, april_early])])
    await rig.project()

    # Within the grace window nothing closes; after it, March closes for both tenants.
    assert await close_periods(rig.ctx, now=at(2026, 4, 1, 0, 59)) == []
    closed = await close_periods(rig.ctx, now=at(2026, 4, 1, 2))
    assert [i.invoice_id for i in closed] == ["inv_acme_202603", "inv_globex_202603"]
    acme_march = closed[0]
    assert acme_march.status == "finalized"
    outputs = {
        (ln.plan_id, ln.quantity, ln.amount)
        for ln in acme_march.lines
        if ln.token_class == "output"
    }
    assert outputs == {("p1", 1_500_000, Decimal("4.50")), ("p2", 1_000_000, Decimal("2.40"))}
    # Input 2,001,000 at 0.50 = 1.0005 -> 1.00 (half-even); 600,000 at 0.40; 400,000 cached at 0.25.
    assert acme_march.total == sum(map(Decimal, ["4.50", "2.40", "1.00", "0.24", "0.10"]))
    seq, event = await read_finalized(rig.ctx.js, rig.layout.prefix, "inv_acme_202603") or (0, None)
    assert event is not None and event.digest == acme_march.content_digest

    # Idempotent: a second run (another replica, a restart) closes nothing more.
    assert await close_periods(rig.ctx, now=at(2026, 4, 1, 3)) == []
    # A crash between publishing and recording: the next run adopts the finalization.
    await rig.pool.execute("DELETE FROM invoices WHERE invoice_id = 'inv_acme_202603'")
    adopted = await close_periods(rig.ctx, now=at(2026, 4, 1, 4))
    assert [invoice_json(i) for i in adopted] == [invoice_json(acme_march)]

    # Late March usage, then April's: April carries March's as an adjustment.
    late = finished("r5", at(2026, 3, 31, 23), completion=1_000_000, prompt=0)
    april = finished("r6", at(2026, 4, 10), completion=2_000_000, prompt=0)
    await rig.usage([late, april, delivered(late), delivered(april)])
    await rig.project()
    closed = await close_periods(rig.ctx, now=at(2026, 5, 1, 2))
    assert [i.invoice_id for i in closed] == ["inv_acme_202604"]  # globex had no April usage
    acme_april = closed[0]
    adjustments = [
        (ln.quantity, ln.amount) for ln in acme_april.lines if ln.category == "adjustment"
    ]
    assert adjustments == [(1_000_000, Decimal("2.40"))]
    assert [ln.quantity for ln in acme_april.lines if ln.category == "usage"] == [3_000_000]
    stored_march = await rig.store.invoice("inv_acme_202603")
    assert stored_march is not None and invoice_json(stored_march) == invoice_json(acme_march)

    # A full rebuild of the invoices read model from the log gives the same documents.
    before = {i.invoice_id: invoice_json(i) for i in await rig.store.invoices()}
    head = await rig.events.head(rig.layout.control_stream)
    await Projector(rig.nc, rig.database_url, rig.layout, InvoicesProjection()).run(
        until_seq=head, reset=True
    )
    assert {i.invoice_id: invoice_json(i) for i in await rig.store.invoices()} == before

    rig.ctx.settings = replace(rig.ctx.settings, reconcile_window_s=400 * 86400)
    report = await reconcile(rig.ctx, now=at(2026, 5, 1, 3))
    assert report.ok, report.as_dict()
    assert report.as_dict()["metering"]["match_percent"] == "100.00"
    assert (report.metering.requests, report.metering.matched) == (7, 7)
    assert {c.tenant_id: c.billed_percent for c in report.billing} == {
        "acme": Decimal("100.00"),
        "globex": Decimal("100.00"),
    }
    assert len(report.rebuilds) == 3 and all(c.equal for c in report.rebuilds)


async def test_ten_thousand_requests_with_cancels_reconcile_at_100_percent(rig: BillingRig) -> None:
    await setup_catalogue(rig)
    rng = random.Random(42)
    start = at(2026, 3, 1)
    usage: list[RequestFinished | GatewayDelivered] = []
    for i in range(10_000):
        cancelled = rng.random() < 0.15
        prompt = rng.randint(16, 4096)
        event = finished(
            f"req-{i:05d}",
            start + timedelta(seconds=rng.randrange(31 * 86400)),
            tenant_id=rng.choice(["acme", "globex", "initech"]),
            key_id=rng.choice(["key-1", "key-2"]),
            prompt=prompt,
            cached=rng.choice([0, 0, prompt // 2]),
            completion=rng.randint(0, 40) if cancelled else rng.randint(1, 512),
            finish_reason="cancelled" if cancelled else rng.choice(["stop", "length"]),
        )
        usage += [event, delivered(event)]
    t0 = time.perf_counter()
    await rig.usage(usage)
    await rig.project()
    closed = await close_periods(rig.ctx, now=at(2026, 4, 2))
    rig.ctx.settings = replace(rig.ctx.settings, reconcile_window_s=60 * 86400)
    report = await reconcile(rig.ctx, now=at(2026, 4, 2))
    elapsed = time.perf_counter() - t0
    assert len(closed) == 3
    m = report.metering
    assert (m.requests, m.matched, m.mismatches) == (10_000, 10_000, [])
    assert report.as_dict()["metering"]["match_percent"] == "100.00"
    assert m.billed_completion_tokens == m.delivered_completion_tokens
    assert all(c.billed_percent == Decimal("100.00") for c in report.billing)
    assert all(c.equal for c in report.rebuilds) and report.ok
    # Each invoice ties to its chargeback CSV and to ledger x prices, to the cent.
    book = await rig.store.price_book()
    ledger = await rig.store.ledger_rows()
    assert sum(1 for r in ledger if r.finish_reason == "cancelled") > 1000
    for invoice in closed:
        table = csv.DictReader(
            io.StringIO(
                showback_csv(invoice_showback(invoice.basis, ledger, book, "hour")).decode()
            )
        )
        assert sum(Decimal(r["x_InvoicedCost"]) for r in table) == invoice.total
    assert elapsed < 60, f"10k-request billing run took {elapsed:.1f}s"


async def test_rollups_are_incremental_and_idempotent(rig: BillingRig) -> None:
    await setup_catalogue(rig)
    first = [
        finished(
            f"a{i}",
            at(2026, 3, 1, 10, i),
            completion=10 + i,
            finish_reason="cancelled" if i % 3 == 0 else "stop",
        )
        for i in range(30)
    ]
    await rig.usage(first)
    await rig.project()
    assert await refresh_rollups(rig.ctx) == 30
    assert await refresh_rollups(rig.ctx) == 30  # nothing new: unchanged
    # A late row for an already rolled-up hour, and a new hour.
    await rig.usage(
        [
            finished("late", at(2026, 3, 1, 10, 59), completion=1000),
            finished("b", at(2026, 3, 1, 11, 5), completion=7),
        ]
    )
    await rig.project()
    assert await refresh_rollups(rig.ctx) == 32
    rows = await rig.pool.fetch(
        "SELECT bucket_start, requests, cancelled, completion_tokens FROM usage_rollups ORDER BY bucket_start"
    )
    assert [
        (r["bucket_start"], r["requests"], r["cancelled"], r["completion_tokens"]) for r in rows
    ] == [
        (at(2026, 3, 1, 10), 31, 10, sum(10 + i for i in range(30)) + 1000),
        (at(2026, 3, 1, 11), 1, 0, 7),
    ]


async def test_capacity_projection_from_measured_throughput(rig: BillingRig) -> None:
    await setup_catalogue(rig)
    now = at(2026, 3, 20, 12)
    # Two overlapping requests: 3,876 output tokens over 10 busy seconds = 387.6 tok/s.
    await rig.usage(
        [
            finished(
                "c1",
                now - timedelta(seconds=50),
                started=now - timedelta(seconds=60),
                completion=1938,
            ),
            finished(
                "c2",
                now - timedelta(seconds=52),
                started=now - timedelta(seconds=58),
                completion=1938,
            ),
        ]
    )
    await rig.project()
    rig.ctx.settings = replace(rig.ctx.settings, gpu_hour_costs={"H200": Decimal("2.00")})
    projections = await refresh_capacity(rig.ctx, now=now)
    qwen = projections["qwen"]
    assert qwen["output_tokens_per_second"] == "387.6000"
    assert qwen["output_tokens_per_period"] == 703_261_440
    assert qwen["gpu_hours_per_million_output"] == "0.7167"
    assert qwen["cost_per_period"] == "1440.00" and qwen["revenue_per_million_output"] is not None
    stored = await rig.pool.fetchval(
        "SELECT document->>'margin_per_period' FROM capacity_projections WHERE sku_id = 'qwen'"
    )
    assert stored == qwen["margin_per_period"]


async def test_worker_busy_in_sql_counts_as_the_ledger_rows_do(rig: BillingRig) -> None:
    """The capacity job measures busy time in the database (it no longer loads the window's
    rows): on random overlapping, nested, touching and disjoint requests of three workers
    and another SKU, the same throughput as `throughput_from_ledger` over the rows."""
    await setup_catalogue(rig)
    await rig.control(sku("other"))
    now = at(2026, 3, 20, 12)
    rng = random.Random(7)
    events = []
    for i in range(300):
        start = now - timedelta(seconds=rng.uniform(1, 3000), microseconds=rng.randrange(10**6))
        length = timedelta(seconds=rng.choice([0, 0.5, 3, 30, 200]) * rng.random())
        worker, sku_id = rng.choice(["w1", "w2", "w3"]), rng.choice(["qwen", "qwen", "other"])
        events.append(
            finished(f"b{i}", start + length, started=start, worker_id=worker, sku_id=sku_id,
                     completion=rng.randrange(0, 500), prompt=rng.randrange(0, 900))
        )  # fmt: skip
    # Two that touch (one starts when the other ends) and one outside the window.
    events += [
        finished("t1", now - timedelta(seconds=9), started=now - timedelta(seconds=19), worker_id="w4"),
        finished("t2", now - timedelta(seconds=2), started=now - timedelta(seconds=9), worker_id="w4"),
        finished("old", now - timedelta(days=2), started=now - timedelta(days=3), worker_id="w4"),
    ]  # fmt: skip
    await rig.usage(events)
    await rig.project()
    start = now - timedelta(hours=1)
    for sku_id in ("qwen", "other"):
        rows = await rig.ctx.store.ledger_rows(sku_id=sku_id, start=start, end=now)
        assert len(rows) > 50
        expected = throughput_from_ledger(rows, sku_id)
        got = throughput_from_busy(sku_id, await rig.ctx.store.worker_busy(sku_id, start, now))
        assert got == expected
    # Touching requests are one busy span: 17 s (10 + 7), the old one outside the window.
    busy = {w.worker_id: w for w in await rig.ctx.store.worker_busy("qwen", start, now)}
    assert busy["w4"].busy_seconds == 17 and busy["w4"].completion_tokens == 200


async def test_one_scheduler_leads_and_another_takes_over(rig: BillingRig) -> None:
    rig.ctx.settings = replace(rig.ctx.settings, lock_ttl_s=1.5)
    ran: list[str] = []

    def job(owner: str):  # noqa: ANN202
        async def run(ctx: object) -> None:
            ran.append(owner)

        return run

    a = BillingScheduler(rig.ctx, {"tick": (job("a"), 0.1)}, owner="a")
    b = BillingScheduler(rig.ctx, {"tick": (job("b"), 0.1)}, owner="b")
    await a.start()
    await b.start()
    await asyncio.sleep(1.0)
    assert a.lock.is_leader and not b.lock.is_leader
    assert ran and set(ran) == {"a"}
    # The leader stops without releasing (a crash): its key expires and b takes over.
    a.scheduler.shutdown(wait=False)
    for _ in range(50):
        if b.lock.is_leader:
            break
        await asyncio.sleep(0.1)
    assert b.lock.is_leader
    # from b's takeover on, only b runs the job (a tick of a's already handed to the event
    # loop when it stopped may still land before: a crashed leader's last run, not a second
    # leader)
    ran.clear()
    await asyncio.sleep(0.5)
    assert ran and set(ran) == {"b"}
    assert await a.lock.renew() is False  # the old leader cannot renew behind b's back
    # A clean stop releases at once.
    await b.stop()
    c = LeaderLock(rig.ctx.js, f"{rig.ctx.prefix}_scheduler", 1.5, owner="c")
    assert await c.renew() is True
    await c.release()
