"""The OpenAI-compatible data plane (`/v1`) and the gateway that dispatches to workers.

Plugs into the app as an Extension. It shares its `DataPlane` as `extra["dataplane"]` (other
extensions add outcome listeners with `on_outcome`), and uses the governance extension's
`extra["admission"]` (quotas, rate limits) when there is one, and reports its open
reservations to the observability extension's `extra["metrics"]`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from control_plane.app import Extension
    from control_plane.services import Services


def tokenmill_extension(services: Services) -> Extension:
    from control_plane.app import Extension
    from control_plane.dataplane.demo import demo_up_hook
    from control_plane.dataplane.openapi import V1OpenAPI
    from control_plane.dataplane.reservations import ReservationsReporter
    from control_plane.dataplane.routes import DataPlane, V1Errors

    assert services.settings.nats_url is not None
    from control_plane.dataplane.limits import InputLimits

    plane = DataPlane(
        services.settings.nats_url,
        services.layout.prefix,
        services.view,
        limits=InputLimits.from_settings(services.settings),
    )

    @contextlib.asynccontextmanager
    async def running(services: Services) -> AsyncIterator[None]:
        # Extensions load in order; by the time the app starts, governance has shared its own.
        plane.admission = services.extra.get("admission")
        metrics = services.extra.get("metrics")
        await plane.start()
        # What the process holds by now (modules, the app, its routes) lives as long as it
        # does: out of the collector's sight, a full collection no longer walks it (tens of
        # ms on this app, every stream stalled meanwhile).
        gc.collect()
        gc.freeze()
        reporting = None
        if plane.admission is not None and metrics is not None:
            reporter = ReservationsReporter(plane.admission, metrics, services.view)
            reporting = asyncio.create_task(reporter.run())
        try:
            yield
        finally:
            if reporting is not None:
                reporting.cancel()
            await plane.stop()
            gc.unfreeze()

    return Extension(
        name="dataplane",
        route_handlers=[plane.router()],
        plugins=[V1Errors(), V1OpenAPI()],
        lifespan=[running],
        up_hooks=[demo_up_hook],
        extra={"dataplane": plane},
    )
