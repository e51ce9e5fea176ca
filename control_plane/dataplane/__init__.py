"""The OpenAI-compatible data plane (`/v1`) and the gateway that dispatches to workers.

Plugs into the app as an Extension whose `dataplane` is the `DataPlane`: other extensions add
admission checks there (`admission_checks`) and outcome listeners (`on_outcome`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from control_plane.app import Extension
from control_plane.dataplane.routes import DataPlane
from control_plane.services import Services


@dataclass
class DataPlaneExtension(Extension):
    dataplane: DataPlane | None = None


def tokenmill_extension(services: Services) -> DataPlaneExtension:
    from control_plane.dataplane.demo import demo_up_hook

    assert services.settings.nats_url is not None
    plane = DataPlane(services.settings.nats_url, services.layout.prefix, services.view)

    @contextlib.asynccontextmanager
    async def running(_: Services) -> AsyncIterator[None]:
        await plane.start()
        try:
            yield
        finally:
            await plane.stop()

    return DataPlaneExtension(
        name="dataplane",
        route_handlers=[plane.router()],
        lifespan=[running],
        up_hooks=[demo_up_hook],
        dataplane=plane,
        extra={"dataplane": plane},  # for other extensions: outcome listeners, admission checks
    )
