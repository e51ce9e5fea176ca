"""`tokenmill invoices ...` and `tokenmill capacity ...` (wired in tokenmill/cli.py).

    tokenmill invoices list [--tenant T]
    tokenmill invoices show ID | --tenant T --period 2026-03  [--format json|csv]
    tokenmill invoices close [--now ISO]            finalize every closable month (idempotent)
    tokenmill invoices showback --from ISO --to ISO [--tenant T] [--granularity hour|day]
    tokenmill invoices rollups | report             run the rollup / reconciliation job once
    tokenmill scheduler                             run all billing jobs (one leader)
    tokenmill capacity (--bench bench/results/...-gpu_endpoint.json ... | --sku S --tok-s 387.6)
                       [--concurrency 8] [--ttft-p95-max 0.5] [--e2e-p95-max 3]
                       [--gpu-hour-cost 2.00] [--busy 0.5 --busy 0.7 ...] [--output-price 3.00]
                       [--json]

Connections come from --database-url / --nats-url or TOKENMILL_DATABASE_URL / TOKENMILL_NATS_URL
(and TOKENMILL_STREAM_PREFIX). Writes the document to stdout, or to --out."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import asyncpg

from events.nats_cluster import connect as connect_nats
from events.projections import all_projections, ensure_schema
from pricing.capacity import CapacityInputs, Throughput, bench_points, choose_points, project
from pricing.invoices import invoice_csv, invoice_json
from pricing.jobs import (
    BillingContext,
    BillingScheduler,
    BillingSettings,
    close_periods,
    reconcile,
    refresh_rollups,
)
from pricing.money import plain, to_decimal
from pricing.periods import BillingPeriod, parse_instant
from pricing.queries import invoice_for, showback_export
from pricing.store import BillingStore
from tokenmill.settings import env


def _add_connection_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--database-url",
        default=env("TOKENMILL_DATABASE_URL"),
        help="PostgreSQL of the instance (TOKENMILL_DATABASE_URL)",
    )
    ap.add_argument(
        "--nats-url",
        default=env("TOKENMILL_NATS_URL"),
        help="NATS of the instance (TOKENMILL_NATS_URL)",
    )
    ap.add_argument(
        "--prefix",
        default=env("TOKENMILL_STREAM_PREFIX", "TM"),
        help="stream name prefix (TOKENMILL_STREAM_PREFIX, TM)",
    )


def _invoices_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenmill invoices", description="Invoices and showback.")
    _add_connection_args(ap)
    ap.add_argument("--out", type=Path, help="write here instead of stdout")
    sub = ap.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="finalized invoices")
    ls.add_argument("--tenant", help="only this tenant's (id)")
    show = sub.add_parser("show", help="one invoice: finalized, or the draft as of now")
    show.add_argument("invoice_id", nargs="?", help="a finalized invoice's id")
    show.add_argument("--tenant", help="tenant id (with --period, instead of an invoice id)")
    show.add_argument("--period", type=BillingPeriod.parse, help="billing month, YYYY-MM")
    show.add_argument(
        "--format", choices=("json", "csv"), default="json", help="document format (json)"
    )
    close = sub.add_parser("close", help="finalize every month past its grace window")
    close.add_argument(
        "--now", type=parse_instant, help="close as of this ISO 8601 instant (default: now)"
    )
    sb = sub.add_parser("showback", help="FOCUS-style chargeback/showback CSV")
    sb.add_argument(
        "--from", dest="start", type=parse_instant, required=True, help="ISO 8601, inclusive"
    )
    sb.add_argument(
        "--to", dest="end", type=parse_instant, required=True, help="ISO 8601, exclusive"
    )
    sb.add_argument("--tenant", help="only this tenant's usage (id)")
    sb.add_argument(
        "--granularity", choices=("hour", "day"), default="day", help="row per hour or day"
    )
    sub.add_parser("rollups", help="bring the hourly usage rollups up to date")
    sub.add_parser("report", help="run the reconciliation report now")
    return ap


@asynccontextmanager
async def _context(args: argparse.Namespace, need_nats: bool) -> AsyncIterator[BillingContext]:
    if not args.database_url:
        raise SystemExit("tokenmill invoices: give --database-url or set TOKENMILL_DATABASE_URL")
    if need_nats and not args.nats_url:
        raise SystemExit("tokenmill invoices: give --nats-url or set TOKENMILL_NATS_URL")
    pool = await asyncpg.create_pool(args.database_url, min_size=1, max_size=4)
    assert pool is not None
    nc = await connect_nats(args.nats_url, name="tokenmill billing") if need_nats else None
    try:
        async with pool.acquire() as conn:  # the read models billing reads, on a fresh database
            await ensure_schema(conn, all_projections())
        store = BillingStore(pool)
        await store.ensure_schema()
        js = nc.jetstream() if nc is not None else None
        yield BillingContext(store=store, js=js, prefix=args.prefix, settings=BillingSettings())  # type: ignore[arg-type]
    finally:
        if nc is not None:
            await nc.drain()
        await pool.close()


def _note(args: argparse.Namespace, message: str) -> None:
    print(f"tokenmill invoices {args.command}: {message}", file=sys.stderr)


def _emit(args: argparse.Namespace, data: bytes) -> None:
    if args.out:
        args.out.write_bytes(data)
    else:
        sys.stdout.buffer.write(data if data.endswith(b"\n") else data + b"\n")
        sys.stdout.flush()


async def invoices_main(argv: list[str] | None = None) -> int:
    args = _invoices_parser().parse_args(argv)
    async with _context(args, need_nats=args.command == "close") as ctx:
        store = ctx.store
        if args.command == "list":
            rows = [
                f"{i.invoice_id}\t{i.tenant_id}\t{i.period.label}\t{i.status}\t{plain(i.total)} {i.currency}"
                for i in await store.invoices(args.tenant)
            ]
            if rows:
                _emit(args, "\n".join(rows).encode())
            else:  # a note for people; stdout stays empty for tools
                whose = f" of tenant {args.tenant}" if args.tenant else ""
                _note(args, f"no finalized invoices{whose}")
        elif args.command == "show":
            if args.invoice_id:
                invoice = await store.invoice(args.invoice_id)
                if invoice is None:
                    print(f"no finalized invoice {args.invoice_id}", file=sys.stderr)
                    return 1
            elif args.tenant and args.period:
                invoice = await invoice_for(
                    store, args.tenant, args.period, ctx.settings.default_currency
                )
            else:
                print("show: give an invoice id, or --tenant and --period", file=sys.stderr)
                return 2
            _emit(args, invoice_json(invoice) if args.format == "json" else invoice_csv(invoice))
        elif args.command == "close":
            closed = await close_periods(ctx, args.now)
            if closed:
                _emit(
                    args,
                    "\n".join(
                        f"finalized {i.invoice_id} {plain(i.total)} {i.currency}" for i in closed
                    ).encode(),
                )
            else:
                _note(args, "nothing to finalize: every closable month is finalized")
        elif args.command == "showback":
            export = await showback_export(
                store,
                args.start,
                args.end,
                args.granularity,
                args.tenant,
                ctx.settings.default_currency,
            )
            _emit(args, export)
            if export.count(b"\n") <= 1:  # the header only
                whose = f" of tenant {args.tenant}" if args.tenant else ""
                _note(
                    args, f"no usage{whose} from {args.start.isoformat()} to {args.end.isoformat()}"
                )
        elif args.command == "rollups":
            _emit(args, f"rollups at ledger sequence {await refresh_rollups(ctx)}".encode())
        elif args.command == "report":
            report = await reconcile(ctx)
            _emit(args, json.dumps(report.as_dict(), indent=2, default=str).encode())
            return 0 if report.ok else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(invoices_main(argv))


def _scheduler_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tokenmill scheduler",
        description="Run the billing jobs until stopped; replicas elect one leader.",
    )
    _add_connection_args(ap)
    return ap


async def scheduler_main(argv: list[str] | None = None, stop: asyncio.Event | None = None) -> int:
    """`tokenmill scheduler`: run the billing jobs until `stop` is set (or the task is
    cancelled); replicas elect one leader."""
    args = _scheduler_parser().parse_args(argv)
    async with _context(args, need_nats=True) as ctx:
        scheduler = BillingScheduler(ctx)
        await scheduler.start()
        try:
            await (stop or asyncio.Event()).wait()
        finally:
            await scheduler.stop()
    return 0


# -- capacity (no servers needed) ----------------------------------------------------------


def _capacity_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tokenmill capacity",
        description=(
            "GPU-hours per 1M output tokens, tokens per period, cost and margin per SKU, from "
            "benchmark results (bench/results/*.json: gpu_suite, gpu_endpoint, or a file with "
            "an aggregate output tok/s) or a throughput you give. From results, each SKU is "
            "projected from its best measured point at the chosen concurrency and within the "
            "latency SLO. A GPU-hour cost not given is unknown: cost and margin show as such."
        ),
    )
    ap.add_argument(
        "--bench",
        type=Path,
        action="append",
        default=[],
        help="benchmark results JSON (repeatable), e.g. "
        "bench/results/2026-11-30-h200-b43d07f-gpu_endpoint.json",
    )
    ap.add_argument(
        "--sku",
        help="with --tok-s: the SKU measured; with --bench: keep only this SKU's points",
    )
    ap.add_argument("--tok-s", type=to_decimal, help="measured aggregate output tokens/s")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs per replica (with --tok-s)")
    ap.add_argument(
        "--concurrency",
        type=int,
        help="project from the points measured at this many concurrent requests",
    )
    ap.add_argument(
        "--ttft-p95-max",
        type=to_decimal,
        metavar="S",
        help="SLO: only points whose p95 time to first token is at most S seconds",
    )
    ap.add_argument(
        "--e2e-p95-max",
        type=to_decimal,
        metavar="S",
        help="SLO: only points whose p95 end-to-end latency is at most S seconds",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="only points of this kind (repeatable): engine (gpu_suite), gateway or direct "
        "(gpu_endpoint)",
    )
    ap.add_argument(
        "--gpu-hour-cost",
        type=to_decimal,
        help="cost of one GPU-hour; without it cost and margin are reported unknown",
    )
    ap.add_argument("--currency", default="USD", help="currency of costs and prices (USD)")
    ap.add_argument(
        "--busy",
        type=to_decimal,
        action="append",
        help="busy fraction(s) of the period (repeatable); default 0.70",
    )
    ap.add_argument("--days", type=int, default=30, help="days in the period (30)")
    ap.add_argument("--output-price", type=to_decimal, help="price per 1M output tokens")
    ap.add_argument("--input-price", type=to_decimal, help="price per 1M input tokens")
    ap.add_argument("--cached-price", type=to_decimal, help="price per 1M cached input tokens")
    ap.add_argument(
        "--input-per-output",
        type=to_decimal,
        help="input tokens per output token (default: the benchmark's request mix, else 0)",
    )
    ap.add_argument(
        "--cached-share",
        type=to_decimal,
        default=Decimal(0),
        help="share of the input that is cached, 0 to 1 (0)",
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return ap


def capacity_main(argv: list[str] | None = None) -> int:
    args = _capacity_parser().parse_args(argv)
    measured: list[Throughput] = []
    if args.bench:
        try:
            points = [p for path in args.bench for p in bench_points(path, args.sku)]
            chosen = choose_points(
                points,
                concurrency=args.concurrency,
                ttft_p95_max_s=args.ttft_p95_max,
                e2e_p95_max_s=args.e2e_p95_max,
                variants=args.variant,
                sku_ids=[args.sku]
                if args.sku and any(p.sku_id == args.sku for p in points)
                else [],
            )
        except (OSError, ValueError) as e:
            raise SystemExit(f"tokenmill capacity: {e}") from None
        measured += [p.throughput() for p in chosen]
    if args.tok_s is not None:
        if not args.sku:
            raise SystemExit("tokenmill capacity: --tok-s needs --sku")
        measured.append(Throughput(args.sku, args.tok_s, gpus=args.gpus, source="given"))
    if not measured:
        raise SystemExit("tokenmill capacity: give --bench FILE or --sku with --tok-s")
    base = CapacityInputs(
        gpu_hour_cost=args.gpu_hour_cost,
        currency=args.currency,
        days=args.days,
        output_price=args.output_price,
        input_price=args.input_price,
        cached_input_price=args.cached_price,
        input_tokens_per_output_token=args.input_per_output,
        cached_share_of_input=args.cached_share,
        unknown_cost_reason="no GPU-hour cost given (--gpu-hour-cost)",
    )
    projections = [
        project(t, replace(base, busy_fraction=busy))
        for t in measured
        for busy in (args.busy or [Decimal("0.70")])
    ]
    if args.json:
        print(json.dumps([p.as_dict() for p in projections], indent=2))
        return 0

    def show(value: Decimal | None) -> str:
        return "?" if value is None else plain(value)

    header = (
        f"{'sku':<20} {'measured':<40} {'tok/s':>9} {'busy':>5} {'GPU-h/1M':>9} "
        f"{'M tok/' + str(args.days) + 'd':>11} {'cost/1M':>9} {'price/1M':>9} "
        f"{'margin/1M':>10} {'margin':>7} {'break-even':>10}"
    )
    print(header)
    for p in projections:
        margin = "?" if p.margin_fraction is None else f"{p.margin_fraction * 100:.1f}%"
        price = "-" if p.revenue_per_million_output is None else plain(p.revenue_per_million_output)
        if p.revenue_per_million_output is None:
            margin = "-"
        print(
            f"{p.sku_id:<20} {p.source:<40} {plain(p.output_tokens_per_second.quantize(Decimal('0.1'))):>9} "
            f"{plain(p.busy_fraction):>5} {plain(p.gpu_hours_per_million_output):>9} "
            f"{p.output_tokens_per_period / 1e6:>11.1f} {show(p.cost_per_million_output):>9} "
            f"{price:>9} {show(p.margin_per_million_output) if price != '-' else '-':>10} "
            f"{margin:>7} {show(p.breakeven_busy_fraction) if price != '-' else '-':>10}"
        )
    reasons = sorted({why for p in projections for why in p.unknown.values()})
    for why in reasons:
        print(f"? unknown: {why}")
    return 0
