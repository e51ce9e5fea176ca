"""The operations view: Prometheus metrics (`/metrics`), the operator's page (`/ui/`) and its
JSON (`/admin/v1/ops/*`).

Plugs into the app as an Extension; `extra["metrics"]` is the app's `OpsMetrics`, for any
other part that wants to record something (`refuse_admission`, `set_open_reservations`...)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from control_plane.observability.metrics import ObservabilitySettings, OpsMetrics

if TYPE_CHECKING:
    from control_plane.app import Extension
    from control_plane.services import Services

__all__ = ["ObservabilitySettings", "OpsMetrics", "tokenmill_extension"]


def _dataplane(services: Services) -> Any:
    """The running DataPlane, as its extension shared it (None when there is none)."""
    return services.extra.get("dataplane")


def _sku_name(services: Services, requested: str) -> str | None:
    """The published SKU a request's `model` names, as its metrics label (None: unknown)."""
    sku = services.view.sku_by_name(requested)
    return sku.name if sku is not None else None


def tokenmill_extension(services: Services) -> Extension:
    from control_plane.app import Extension
    from control_plane.auth import admin_guard
    from control_plane.observability.feed import RefusalCounter, feeding, outcome_listener
    from control_plane.observability.routes import observability_routes

    metrics = OpsMetrics()

    @contextlib.asynccontextmanager
    async def gateway_outcomes(services: Services) -> AsyncIterator[None]:
        # Entered after the data plane's own lifespan hook, so its gateway is running.
        plane = _dataplane(services)
        if plane is not None:
            plane.gateway.on_outcome(outcome_listener(metrics, services.view))
        yield

    return Extension(
        name="observability",
        route_handlers=observability_routes(metrics, [admin_guard(services.admin_token)]),
        plugins=[RefusalCounter(metrics, sku_of=lambda name: _sku_name(services, name))],
        lifespan=[feeding(metrics), gateway_outcomes],
        extra={"metrics": metrics},
    )
