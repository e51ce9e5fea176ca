"""Admission: who is calling (`keys`, against the in-memory governance view in `view`) and
whether they may send this request now (`admit`: quotas, rate limits and tenant policy, exact
under concurrency and across gateway replicas; see `budgets` for the shared-state design,
`settled_usage` for what the usage stream settles, `controllers` for the HTTP endpoints).

As an app Extension it starts one `Admission` per process, mounts the admin limits routes and
`GET /v1/usage`, and offers the Admission to the data plane as `extra["admission"]`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from control_plane.admission.admit import Admission, Refusal, Ticket, rate_limit_headers
from events.control import LimitsSet
from tokenmill.settings import AdmissionSettings

if TYPE_CHECKING:
    from control_plane.app import Extension
    from control_plane.services import Services

__all__ = [
    "Admission",
    "AdmissionSettings",
    "LimitsSet",
    "Refusal",
    "Ticket",
    "rate_limit_headers",
    "tokenmill_extension",
]


def tokenmill_extension(services: Services) -> Extension:
    from control_plane.admission.controllers import governance_admin_router, usage_router
    from control_plane.app import Extension

    admission = Admission(services.nc, services.layout.prefix, services.view)

    @contextlib.asynccontextmanager
    async def running(_: Services) -> AsyncIterator[None]:
        await admission.start()
        try:
            yield
        finally:
            await admission.stop()

    return Extension(
        name="governance",
        route_handlers=[
            governance_admin_router(services, admission),
            usage_router(services, admission),
        ],
        lifespan=[running],
        extra={"admission": admission},
    )
