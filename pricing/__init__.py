"""Price plans, invoices, chargeback/showback exports and capacity projections.

As an app Extension (control_plane.app loads `tokenmill_extension`): billing's tables at app
start, the billing admin routes (`pricing.api`), and under `tokenmill up` the scheduled jobs
(`pricing.jobs`; one leader among replicas). A separate deployment runs the jobs with
`tokenmill scheduler` instead. `extra["billing"]` is the BillingContext."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from control_plane.app import Extension
    from control_plane.services import Services


def tokenmill_extension(services: Services) -> Extension:
    from control_plane.app import Extension
    from pricing.api import billing_admin_router
    from pricing.jobs import BillingContext, BillingScheduler
    from pricing.store import BillingStore

    ctx = BillingContext(
        store=BillingStore(services.pool), js=services.js, prefix=services.layout.prefix
    )

    @contextlib.asynccontextmanager
    async def schema(_: Services) -> AsyncIterator[None]:
        await ctx.store.ensure_schema()
        yield

    @contextlib.asynccontextmanager
    async def scheduled_jobs(_: Services) -> AsyncIterator[None]:
        scheduler = BillingScheduler(ctx)
        await scheduler.start()
        try:
            yield
        finally:
            await scheduler.stop()

    return Extension(
        name="billing",
        route_handlers=[billing_admin_router(services, ctx)],
        lifespan=[schema],
        up_hooks=[scheduled_jobs],
        extra={"billing": ctx},
    )
