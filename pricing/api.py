"""Billing's admin API, under /admin/v1 with the admin bearer token; errors are RFC 9457
problem details. Reads come from Postgres; `?consistent=true` first waits until the read
models (ledger, price plans, invoices) hold every event appended so far.

    GET  /invoices?tenant_id=&period=YYYY-MM              finalized invoices (summaries)
    GET  /invoices/{invoice_id}                           one finalized invoice
    GET  /tenants/{tenant_id}/invoices/{period}           finalized, else the draft as of now
    POST /tenants/{tenant_id}/invoices/{period}/finalize  draft -> finalized (an event); 409 twice
    GET  /tenants/{tenant_id}/invoices/{period}/export?format=json|csv
    GET  /showback?period=YYYY-MM | from=&to=  [&tenant_id=&granularity=day|hour]   FOCUS CSV
    GET  /capacity                                        the capacity job's latest per SKU
    GET  /capacity/{sku}?tok_s=&busy_fraction=&gpu_hour_cost=&days=&gpus=&output_price=...
                                                          a projection with what-if inputs
"""

from __future__ import annotations

import asyncio
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from litestar import Response, Router, get, post
from litestar.params import Parameter

from control_plane.auth import admin_guard
from control_plane.problems import PROBLEM_HANDLERS, ProblemError, not_found
from control_plane.services import Services
from pricing.invoices import (
    Invoice,
    InvoiceAlreadyFinalized,
    invoice_csv,
    invoice_id,
    invoice_json,
)
from pricing.jobs import BillingContext, PeriodNotClosable, finalize_period
from pricing.money import plain, to_decimal
from pricing.periods import BillingPeriod, parse_instant
from pricing.queries import (
    NoThroughput,
    capacity_projections,
    capacity_what_if,
    invoice_for,
    showback_export,
)

Consistent = Annotated[
    bool, Parameter(description="wait until the read models include every event so far")
]
PeriodLabel = Annotated[str, Parameter(description="billing month, YYYY-MM (UTC)")]
Amount = Annotated[str | None, Parameter(description="a decimal, e.g. 2.50")]

CSV = "text/csv; charset=utf-8"


def _period(label: str) -> BillingPeriod:
    try:
        return BillingPeriod.parse(label)
    except ValueError as e:
        raise ProblemError(400, "invalid_period", f"period must be YYYY-MM, got {label!r}") from e


def _decimal(name: str, value: str | None) -> Decimal | None:
    if value is None:
        return None
    try:
        return to_decimal(value)
    except (InvalidOperation, ValueError) as e:
        raise ProblemError(
            400, "invalid_request", f"{name} must be a decimal, got {value!r}"
        ) from e


def _summary(invoice: Invoice) -> dict[str, Any]:
    return {
        "invoice_id": invoice.invoice_id,
        "tenant_id": invoice.tenant_id,
        "period": invoice.period.label,
        "status": invoice.status,
        "currency": invoice.currency,
        "total": plain(invoice.total),
        "finalized_at": invoice.finalized_at.isoformat() if invoice.finalized_at else None,
        "lines": len(invoice.lines),
    }


def _document(invoice: Invoice, status: int = 200, **headers: str) -> Response[bytes]:
    # The invoice's own JSON bytes: decimals as strings, exactly as finalized.
    return Response(
        invoice_json(invoice), status_code=status, media_type="application/json", headers=headers
    )


def _attachment(body: bytes, media_type: str, filename: str) -> Response[bytes]:
    return Response(
        body,
        media_type=media_type,
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


async def caught_up(services: Services, within: float = 5.0) -> None:
    """Wait until every projection holds every event appended so far (503 if it does not)."""
    deadline = asyncio.get_running_loop().time() + within
    while any((await services.projection_lags()).values()):
        if asyncio.get_running_loop().time() > deadline:
            raise ProblemError(
                503, "read_models_behind", "the read models did not catch up in time"
            )
        await asyncio.sleep(0.02)


def billing_admin_router(services: Services, ctx: BillingContext) -> Router:
    store = ctx.store

    def known_tenant(tenant_id: str) -> None:
        if services.view.tenant(tenant_id) is None:
            raise not_found("tenant", tenant_id)

    async def current_invoice(tenant_id: str, period: BillingPeriod) -> Invoice:
        try:
            return await invoice_for(store, tenant_id, period, ctx.settings.default_currency)
        except ValueError as e:  # usage priced in several currencies
            raise ProblemError(409, "currency_conflict", str(e)) from e

    @get("/invoices", summary="List finalized invoices")
    async def list_invoices(
        tenant_id: str | None = None,
        period: Annotated[str | None, Parameter(description="YYYY-MM")] = None,
        consistent: Consistent = False,
    ) -> dict[str, Any]:
        if consistent:
            await caught_up(services)
        wanted = _period(period) if period else None
        invoices = [
            i for i in await store.invoices(tenant_id) if wanted is None or i.period == wanted
        ]
        return {"items": [_summary(i) for i in invoices]}

    @get("/invoices/{invoice_id:str}", summary="Get a finalized invoice")
    async def get_finalized(invoice_id: str, consistent: Consistent = False) -> Response[bytes]:
        if consistent:
            await caught_up(services)
        invoice = await store.invoice(invoice_id)
        if invoice is None:
            raise not_found("invoice", invoice_id)
        return _document(invoice)

    @get(
        "/tenants/{tenant_id:str}/invoices/{period:str}",
        summary="A tenant's invoice for a month: finalized, or the draft as of now",
    )
    async def get_invoice(
        tenant_id: str, period: PeriodLabel, consistent: Consistent = False
    ) -> Response[bytes]:
        known_tenant(tenant_id)
        month = _period(period)
        if consistent:
            await caught_up(services)
        return _document(await current_invoice(tenant_id, month))

    @post(
        "/tenants/{tenant_id:str}/invoices/{period:str}/finalize",
        summary="Finalize a tenant's month (an InvoiceFinalized event); a second time is a 409",
    )
    async def finalize_invoice(tenant_id: str, period: PeriodLabel) -> Response[bytes]:
        known_tenant(tenant_id)
        month = _period(period)
        await caught_up(services)  # bill what was served up to now, not what a lag left out
        try:
            invoice = await finalize_period(ctx, tenant_id, month)
        except InvoiceAlreadyFinalized as e:
            raise ProblemError(
                409, "invoice_already_finalized", str(e), invoice_id=invoice_id(tenant_id, month)
            ) from e
        except PeriodNotClosable as e:
            raise ProblemError(409, e.reason, str(e)) from e
        except ValueError as e:
            raise ProblemError(409, "currency_conflict", str(e)) from e
        location = f"/admin/v1/invoices/{invoice.invoice_id}"
        return _document(invoice, 201, Location=location)

    @get(
        "/tenants/{tenant_id:str}/invoices/{period:str}/export",
        summary="Export a tenant's invoice for a month as JSON or CSV (one row per line item)",
    )
    async def export_invoice(
        tenant_id: str,
        period: PeriodLabel,
        format: Literal["json", "csv"] = "json",
        consistent: Consistent = False,
    ) -> Response[bytes]:
        known_tenant(tenant_id)
        month = _period(period)
        if consistent:
            await caught_up(services)
        invoice = await current_invoice(tenant_id, month)
        if format == "csv":
            return _attachment(invoice_csv(invoice), CSV, f"{invoice.invoice_id}.csv")
        return _attachment(invoice_json(invoice), "application/json", f"{invoice.invoice_id}.json")

    @get("/showback", summary="Chargeback/showback CSV with FinOps FOCUS columns")
    async def showback(
        period: Annotated[str | None, Parameter(description="YYYY-MM; or from and to")] = None,
        start: Annotated[str | None, Parameter(query="from", description="ISO 8601")] = None,
        end: Annotated[str | None, Parameter(query="to", description="ISO 8601")] = None,
        tenant_id: str | None = None,
        granularity: Literal["day", "hour"] = "day",
        consistent: Consistent = False,
    ) -> Response[bytes]:
        if period is not None:
            month = _period(period)
            window = (month.start, month.end)
            name = month.label
        elif start is not None and end is not None:
            try:
                window = (parse_instant(start), parse_instant(end))
            except ValueError as e:
                raise ProblemError(400, "invalid_request", f"bad from/to: {e}") from e
            if window[0] >= window[1]:
                raise ProblemError(400, "invalid_request", "from must be before to")
            name = f"{window[0]:%Y%m%dT%H%M}-{window[1]:%Y%m%dT%H%M}"
        else:
            raise ProblemError(400, "invalid_request", "give period, or from and to")
        if consistent:
            await caught_up(services)
        body = await showback_export(
            store, *window, granularity, tenant_id, ctx.settings.default_currency
        )
        return _attachment(body, CSV, f"showback-{tenant_id or 'all'}-{name}.csv")

    @get("/capacity", summary="The capacity job's latest projection per SKU")
    async def list_capacity() -> dict[str, Any]:
        return {"items": await capacity_projections(store)}

    @get("/capacity/{sku:str}", summary="Capacity projection of a SKU, with what-if inputs")
    async def sku_capacity(
        sku: Annotated[str, Parameter(description="SKU id or name")],
        tok_s: Annotated[
            str | None, Parameter(description="output tokens/s (else measured)")
        ] = None,
        gpus: Annotated[int, Parameter(ge=1, description="GPUs per replica, with tok_s")] = 1,
        busy_fraction: Annotated[str | None, Parameter(description="0 < busy <= 1")] = None,
        gpu_hour_cost: Amount = None,
        days: Annotated[int | None, Parameter(ge=1, le=366)] = None,
        output_price: Amount = None,
        input_price: Amount = None,
        cached_input_price: Amount = None,
        input_tokens_per_output_token: Amount = None,
        cached_share_of_input: Amount = None,
        consistent: Consistent = False,
    ) -> dict[str, Any]:
        found = services.view.sku(sku) or services.view.sku_by_name(sku)
        if found is None:
            raise not_found("sku", sku)
        given = {
            "busy_fraction": busy_fraction,
            "gpu_hour_cost": gpu_hour_cost,
            "output_price": output_price,
            "input_price": input_price,
            "cached_input_price": cached_input_price,
            "input_tokens_per_output_token": input_tokens_per_output_token,
            "cached_share_of_input": cached_share_of_input,
        }
        what_if: dict[str, Any] = {k: _decimal(k, v) for k, v in given.items() if v is not None}
        if days is not None:
            what_if["days"] = days
        if consistent:
            await caught_up(services)
        try:
            projection = await capacity_what_if(
                store,
                ctx.settings,
                found.sku_id,
                found.gpu_type,
                ctx.clock(),
                tok_s=_decimal("tok_s", tok_s),
                gpus=gpus,
                **what_if,
            )
        except NoThroughput as e:
            raise ProblemError(
                404, "no_throughput", f"{e}; pass tok_s to project a throughput"
            ) from e
        except ValueError as e:
            raise ProblemError(400, "invalid_request", str(e)) from e
        return {**projection.as_dict(), "gpu_type": found.gpu_type}

    return Router(
        path="/admin/v1",
        route_handlers=[
            list_invoices,
            get_finalized,
            get_invoice,
            finalize_invoice,
            export_invoice,
            showback,
            list_capacity,
            sku_capacity,
        ],
        guards=[admin_guard(services.admin_token)],
        exception_handlers=PROBLEM_HANDLERS,
        security=[{"bearer": []}],
        tags=["billing"],
    )
