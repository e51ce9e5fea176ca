"""Billing jobs on a schedule (APScheduler 3.x), one active instance across replicas.

Jobs (each idempotent, and safe to re-run after a crash at any point):
- close_periods: finalize every tenant's invoices for months that ended more than the grace
  window ago, as of the ledger's committed position; publish InvoiceFinalized (JetStream
  refuses a second one per invoice id) and record it. Re-running closes only what is left.
- refresh_rollups: hourly usage rollups, recomputing the buckets touched by ledger rows past
  the rollup's saved position, rows and position in one transaction.
- refresh_capacity: capacity projection per SKU from throughput measured in the ledger.
- reconcile: metering (worker vs gateway), billing (ledger vs invoices) and rebuild checks,
  stored per window.

Leadership: a JetStream KV bucket holds a `leader` key with a TTL. A replica becomes leader by
creating the key (create-if-absent) and stays leader by updating it with the revision it
last wrote (compare-and-set) every TTL/3; a leader that cannot renew steps down, and a dead
one's key expires so another replica takes over. Jobs run only on the leader.

Size: The scheduler, its leader lock and the jobs it runs: each job is short, the leader logic
is shared.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from events.nats_cluster import ensure_key_value
from pricing.capacity import CapacityInputs, Throughput, project, throughput_from_busy
from pricing.events import finalized_event, publish_finalized, read_finalized
from pricing.invoices import (
    Invoice,
    InvoiceAlreadyFinalized,
    InvoiceBasis,
    LedgerRow,
    PreviousInvoice,
    build_invoice,
    finalize,
    invoice_id,
    iso,
)
from pricing.periods import BillingPeriod, last_closable, utc
from pricing.plans import PriceBook, PricePlan
from pricing.reconcile import ReconciliationReport, check_billing, check_rebuild
from pricing.reconcile import reconcile as reconcile_metering
from pricing.store import BillingStore
from tokenmill.settings import BillingSettings

log = logging.getLogger(__name__)


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class BillingContext:
    store: BillingStore
    js: JetStreamContext
    prefix: str
    settings: BillingSettings = field(default_factory=BillingSettings)
    clock: Callable[[], datetime] = _now


# -- period close -----------------------------------------------------------------------------


def tenant_currency(rows: list[LedgerRow], book: PriceBook, default: str) -> str:
    currencies = {
        plan.currency
        for row in rows
        if (plan := book.in_force(row.sku_id, row.usage_at)) is not None
    }
    if len(currencies) > 1:
        raise ValueError(f"usage priced in several currencies: {sorted(currencies)}")
    return currencies.pop() if currencies else default


@dataclass(frozen=True)
class Cut:
    """What a draft is read as of: the ledger's position, the control stream's, and the
    price book as of the latter."""

    ledger_seq: int
    price_seq: int
    book: PriceBook

    @classmethod
    async def now(cls, store: BillingStore) -> Cut:
        ledger_seq = await store.ledger_position()
        return cls(ledger_seq, await store.control_position(), await store.price_book())


async def draft_invoice(
    store: BillingStore,
    tenant_id: str,
    period: BillingPeriod,
    previous: Invoice | None,
    cut: Cut,
    default_currency: str,
) -> Invoice:
    """The tenant's draft for `period` as of the cut, following its `previous` invoice.
    Raises ValueError if the usage is priced in several currencies."""
    basis = InvoiceBasis(
        tenant_id=tenant_id,
        period=period,
        currency=default_currency,
        cut_seq=max(cut.ledger_seq, previous.cut_seq if previous else 0),
        previous=PreviousInvoice(previous.period_end, previous.cut_seq) if previous else None,
        price_cut_seq=cut.price_seq,
    )
    rows = await store.invoice_rows(basis)
    currency = tenant_currency(rows, cut.book, default_currency)
    return build_invoice(msgspec.structs.replace(basis, currency=currency), rows, cut.book)


async def record_finalization(ctx: BillingContext, invoice: Invoice, *, adopt: bool) -> Invoice:
    """Publish the finalization and record it. If the invoice is already finalized on the
    stream, record that one (the stream is the truth) and return it (`adopt`, as the close job
    does after a crash) or raise InvoiceAlreadyFinalized (an operator's second finalize)."""
    event = finalized_event(invoice)
    try:
        seq = await publish_finalized(ctx.js, ctx.prefix, event)
    except InvoiceAlreadyFinalized:
        found = await read_finalized(ctx.js, ctx.prefix, invoice.invoice_id)
        if found is None:
            raise
        seq, event = found
        if not adopt:
            await ctx.store.record_finalized(event, seq)
            raise
    await ctx.store.record_finalized(event, seq)
    return event.invoice


async def close_periods(ctx: BillingContext, now: datetime | None = None) -> list[Invoice]:
    """Finalize, per tenant and in order, every month up to the last closable one. Returns
    the invoices finalized (or adopted from the stream) by this run."""
    now = now or ctx.clock()
    closable = last_closable(now, ctx.settings.grace)
    cut = await Cut.now(ctx.store)
    done: list[Invoice] = []
    tenants = await ctx.store.ledger_tenants(closable.end, cut.ledger_seq)
    for tenant_id, first_usage in tenants.items():
        previous = await ctx.store.latest_invoice(tenant_id)
        period = previous.period.following() if previous else BillingPeriod.containing(first_usage)
        while utc(period.end) <= utc(closable.end):
            try:
                draft = await draft_invoice(
                    ctx.store, tenant_id, period, previous, cut, ctx.settings.default_currency
                )
            except ValueError:
                log.exception("billing: cannot invoice tenant %s for %s", tenant_id, period.label)
                break
            if draft.lines or draft.unpriced:  # an empty month issues no invoice
                previous = await record_finalization(ctx, finalize(draft, now), adopt=True)
                done.append(previous)
                log.info(
                    "billing: finalized %s total %s %s",
                    previous.invoice_id,
                    previous.total,
                    previous.currency,
                )
            period = period.following()
    return done


class PeriodNotClosable(ValueError):
    """An operator asked to finalize a period that cannot be finalized now; `reason` says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


async def finalize_period(
    ctx: BillingContext, tenant_id: str, period: BillingPeriod, now: datetime | None = None
) -> Invoice:
    """Finalize one tenant's period now, on an operator's request, ignoring the grace window
    (the close job finalizes every period after it). The period must have ended, follow the
    tenant's last invoice, and leave no earlier month with usage unbilled. Raises
    InvoiceAlreadyFinalized for a period that is already finalized."""
    now = now or ctx.clock()
    if utc(period.end) > utc(now):
        raise PeriodNotClosable("period_not_ended", f"{period.label} ends at {iso(period.end)}")
    if await ctx.store.invoice(invoice_id(tenant_id, period)) is not None:
        raise InvoiceAlreadyFinalized(f"{invoice_id(tenant_id, period)} is already finalized")
    cut = await Cut.now(ctx.store)
    previous = await ctx.store.latest_invoice(tenant_id)
    if previous is not None and utc(previous.period_end) > utc(period.start):
        raise PeriodNotClosable(
            "period_superseded",
            f"{previous.invoice_id} for a later period is finalized; {period.label} is closed",
        )
    unbilled = await ctx.store.ledger_rows(
        tenant_id=tenant_id,
        start=previous.period_end if previous else None,
        end=period.start,
        cut_seq=cut.ledger_seq,
    )
    if unbilled:
        earlier = BillingPeriod.containing(min(r.usage_at for r in unbilled))
        raise PeriodNotClosable(
            "earlier_period_open", f"finalize {earlier.label} of {tenant_id} first"
        )
    draft = await draft_invoice(
        ctx.store, tenant_id, period, previous, cut, ctx.settings.default_currency
    )
    if not (draft.lines or draft.unpriced):
        raise PeriodNotClosable("empty_period", f"{tenant_id} has no usage in {period.label}")
    return await record_finalization(ctx, finalize(draft, now), adopt=False)


# -- rollups ----------------------------------------------------------------------------------

ROLLUP_JOB = "usage_rollups"


async def refresh_rollups(ctx: BillingContext) -> int:
    """Bring the hourly rollups up to the ledger's committed position; returns that position.
    The buckets touched by new rows are recomputed whole from the ledger, in one transaction
    with the saved position, so a crash or a second run changes nothing."""
    head = await ctx.store.ledger_position()
    async with ctx.store.pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL timezone = 'UTC'")
        done = await ctx.store.position(conn, ROLLUP_JOB, for_update=True)
        if head <= done:
            return done
        await conn.execute(
            """CREATE TEMP TABLE touched ON COMMIT DROP AS
               SELECT DISTINCT date_trunc('hour', finished_at) AS bucket_start, tenant_id
               FROM usage_ledger WHERE stream_seq > $1 AND stream_seq <= $2""",
            done,
            head,
        )
        await conn.execute(
            """DELETE FROM usage_rollups r USING touched t
               WHERE r.bucket_start = t.bucket_start AND r.tenant_id = t.tenant_id"""
        )
        await conn.execute(
            """INSERT INTO usage_rollups
               SELECT date_trunc('hour', l.finished_at), l.tenant_id, l.key_id, l.sku_id, l.model,
                      count(*), count(*) FILTER (WHERE l.finish_reason = 'cancelled'),
                      sum(l.prompt_tokens), sum(l.cached_tokens), sum(l.completion_tokens)
               FROM usage_ledger l JOIN touched t
                 ON date_trunc('hour', l.finished_at) = t.bucket_start AND l.tenant_id = t.tenant_id
               WHERE l.stream_seq <= $1
               GROUP BY 1, 2, 3, 4, 5""",
            head,
        )
        await ctx.store.save_position(conn, ROLLUP_JOB, head)
    return head


# -- capacity ---------------------------------------------------------------------------------


async def measured_throughput(
    store: BillingStore, sku_id: str, start: datetime, end: datetime
) -> Throughput | None:
    """The SKU's throughput in the ledger's [start, end): its best worker's (an idle-heavy one
    understates what the GPU can do), or None without usage."""
    measured = throughput_from_busy(sku_id, await store.worker_busy(sku_id, start, end))
    return max(measured, key=lambda t: t.output_tokens_per_second) if measured else None


def capacity_inputs(
    settings: BillingSettings, gpu_type: str, plan: PricePlan | None, **what_if: Any
) -> CapacityInputs:
    """The configured GPU cost and busy fraction, changed by `what_if` (CapacityInputs
    fields), priced by the plan in force where no price is given."""
    inputs = CapacityInputs(
        gpu_hour_cost=settings.gpu_hour_costs.get(gpu_type),  # None: unknown, never 0
        busy_fraction=settings.busy_fraction,
        unknown_cost_reason=(
            f"no GPU-hour cost for gpu_type {gpu_type}: set TOKENMILL_GPU_HOUR_COSTS "
            f"(e.g. {gpu_type}=3.50) or pass gpu_hour_cost"
        ),
    )
    inputs = replace(inputs, **what_if)
    return inputs.priced_by(plan) if plan is not None else inputs


async def refresh_capacity(ctx: BillingContext, now: datetime | None = None) -> dict[str, dict]:
    """Project each SKU's month from the throughput its workers showed in the recent ledger."""
    now = now or ctx.clock()
    start = now - timedelta(seconds=ctx.settings.capacity_window_s)
    book = await ctx.store.price_book()
    projections: dict[str, dict] = {}
    for sku in await ctx.store.skus():
        best = await measured_throughput(ctx.store, sku.sku_id, start, now)
        if best is None:
            continue
        inputs = capacity_inputs(ctx.settings, sku.gpu_type, book.in_force(sku.sku_id, now))
        document = {**project(best, inputs).as_dict(), "gpu_type": sku.gpu_type}
        projections[sku.sku_id] = document
        await ctx.store.pool.execute(
            """INSERT INTO capacity_projections VALUES ($1, $2, $3::jsonb)
               ON CONFLICT (sku_id) DO UPDATE SET computed_at = EXCLUDED.computed_at,
               document = EXCLUDED.document""",
            sku.sku_id,
            now,
            _json(document),
        )
    return projections


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str)


# -- reconciliation ---------------------------------------------------------------------------


async def reconcile(ctx: BillingContext, now: datetime | None = None) -> ReconciliationReport:
    """Metering over the window; billing and rebuild checks over all finalized invoices."""
    now = now or ctx.clock()
    start = now - timedelta(seconds=ctx.settings.reconcile_window_s)
    invoices = await ctx.store.invoices()
    book = await ctx.store.price_book()
    rebuilds = []
    billing = []
    if invoices:
        ledger = await ctx.store.ledger_rows(cut_seq=max(i.cut_seq for i in invoices))
        billing = check_billing(invoices, ledger)
        rebuilds = [check_rebuild(invoice, ledger, book) for invoice in invoices]
    report = ReconciliationReport(
        generated_at=now,
        window_start=start,
        window_end=now,
        metering=await reconcile_metering(ctx.store.pool, since=start, until=now),
        billing=billing,
        rebuilds=rebuilds,
    )
    await ctx.store.pool.execute(
        """INSERT INTO billing_reports VALUES ('reconciliation', $1, $2, $3, $4, $5::jsonb)
           ON CONFLICT (kind, window_end) DO UPDATE SET generated_at = EXCLUDED.generated_at,
           ok = EXCLUDED.ok, document = EXCLUDED.document""",
        now,
        start,
        now,
        report.ok,
        _json(report.as_dict()),
    )
    return report


# -- leadership -------------------------------------------------------------------------------


class LeaderLock:
    """One leader among replicas via a TTL'd key in a JetStream KV bucket."""

    KEY = "leader"

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        ttl_s: float,
        owner: str | None = None,
        replicas: int = 1,
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.ttl_s = ttl_s
        self.replicas = replicas
        self.owner = owner or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._kv: KeyValue | None = None
        self._revision: int | None = None
        self._valid_until = 0.0

    def bucket_config(self) -> KeyValueConfig:
        return KeyValueConfig(bucket=self.bucket, ttl=self.ttl_s, history=1, replicas=self.replicas)

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await ensure_key_value(self.js, self.bucket_config())
        return self._kv

    @property
    def is_leader(self) -> bool:
        # Trust leadership only while the key we wrote cannot have expired yet.
        return self._revision is not None and asyncio.get_running_loop().time() < self._valid_until

    async def renew(self) -> bool:
        """Acquire (create-if-absent) or keep (update at our revision) the leader key."""
        kv = await self._bucket()
        started = asyncio.get_running_loop().time()
        try:
            if self._revision is None:
                self._revision = await kv.create(self.KEY, self.owner.encode())
                log.info("scheduler: %s is the leader", self.owner)
            else:
                self._revision = await kv.update(self.KEY, self.owner.encode(), last=self._revision)
        except (KeyWrongLastSequenceError, NotFoundError):
            if self._revision is not None:
                log.warning("scheduler: %s lost the leadership", self.owner)
            self._revision = None
            return False
        self._valid_until = started + self.ttl_s * 0.9
        return True

    async def release(self) -> None:
        if self._revision is None:
            return
        try:
            kv = await self._bucket()
            await kv.delete(self.KEY, last=self._revision)
        except (KeyWrongLastSequenceError, NotFoundError):
            pass
        self._revision = None


Job = Callable[[BillingContext], Awaitable[object]]


def default_jobs(settings: BillingSettings) -> dict[str, tuple[Job, float]]:
    return {
        "close_periods": (close_periods, settings.close_interval_s),
        "refresh_rollups": (refresh_rollups, settings.rollup_interval_s),
        "refresh_capacity": (refresh_capacity, settings.capacity_interval_s),
        "reconcile": (reconcile, settings.reconcile_interval_s),
    }


class BillingScheduler:
    """The jobs on an AsyncIOScheduler, each run only while this replica holds the lock."""

    def __init__(
        self,
        ctx: BillingContext,
        jobs: dict[str, tuple[Job, float]] | None = None,
        owner: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.jobs = jobs if jobs is not None else default_jobs(ctx.settings)
        self.lock = LeaderLock(
            ctx.js,
            f"{ctx.prefix}_scheduler",
            ctx.settings.lock_ttl_s,
            owner,
            replicas=ctx.settings.kv_replicas,
        )
        self.scheduler = AsyncIOScheduler(timezone=UTC)
        self.runs: dict[str, int] = dict.fromkeys(self.jobs, 0)

    async def start(self) -> None:
        # APScheduler logs every run at INFO, the leader renewal every few seconds included;
        # keep its warnings and errors, the jobs log what they do themselves.
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
        await self.lock.renew()
        self.scheduler.add_job(
            self.lock.renew,
            "interval",
            seconds=self.ctx.settings.lock_ttl_s / 3,
            id="leader",
            max_instances=1,
            coalesce=True,
        )
        for name, (job, interval) in self.jobs.items():
            self.scheduler.add_job(
                self._guarded,
                "interval",
                args=(name, job),
                seconds=interval,
                id=name,
                max_instances=1,
                coalesce=True,
                next_run_time=datetime.now(UTC),
            )
        self.scheduler.start()

    async def _guarded(self, name: str, job: Job) -> None:
        if not self.lock.is_leader:
            return
        try:
            await job(self.ctx)
            self.runs[name] += 1
        except Exception:
            # A failed run leaves nothing half-done (each job is transactional or idempotent);
            # the next interval retries it.
            log.exception("billing job %s failed", name)

    async def stop(self) -> None:
        self.scheduler.shutdown(wait=False)
        await self.lock.release()
