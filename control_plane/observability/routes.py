"""HTTP surface of the operations view: `/metrics` for Prometheus (behind its own bearer token
when TOKENMILL_METRICS_TOKEN is set), `/admin/v1/ops/*` JSON for the operator's page (admin
auth), and the page itself under `/ui/`.

The app factory mounts it with `observability_routes(metrics, admin_guards)`. The page's
files carry no secrets: it asks for the admin token in the browser and sends it as a bearer
on every admin call, so the data stays behind the same guard as the rest of `/admin/v1`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date
from pathlib import Path

from litestar import Response, Router, get
from litestar.datastructures import CacheControlHeader
from litestar.di import Provide
from litestar.params import Parameter
from litestar.response import Redirect
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler, Guard

from control_plane.auth import bearer_guard
from control_plane.observability.metrics import PROMETHEUS_TEXT, OpsMetrics
from control_plane.observability.usage import usage_by_tenant, usage_csv
from control_plane.problems import PROBLEM_HANDLERS
from control_plane.services import Services  # a runtime import: Litestar reads the annotations
from tokenmill.settings import Settings

# Security headers of the page: everything from our own origin, nothing inline.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def web_dir() -> Path:
    """Where the page's files are: TOKENMILL_WEB_DIR, else the checkout's `web/`, else the copy
    packaged under `control_plane/static/web`."""
    configured = Settings().web_dir
    if configured:
        return Path(configured)
    here = Path(__file__).resolve()
    checkout = here.parents[2] / "web"
    if (checkout / "index.html").exists():
        return checkout
    return here.parents[1] / "static" / "web"


def scrape_guard(token: str) -> Guard:
    """Admits `Authorization: Bearer <token>` only: Prometheus sends it with
    `authorization: {type: Bearer, credentials: ...}` in its scrape config."""
    return bearer_guard(token, "metrics")


@get("/metrics", media_type=PROMETHEUS_TEXT, include_in_schema=False)
async def metrics_endpoint(metrics: OpsMetrics) -> Response[bytes]:
    await metrics.refresh()  # the scrape-time readers (projection lag)
    return Response(metrics.exposition(), media_type=PROMETHEUS_TEXT)


@get(
    "/timeseries",
    sync_to_thread=False,
    summary="Per-SKU latency, throughput and load history for the operator's page",
)
def timeseries(
    metrics: OpsMetrics,
    window_s: float | None = Parameter(
        default=None,
        gt=0,
        le=86400,
        description="Seconds of history (capped at the in-memory window)",
    ),
) -> dict[str, object]:
    return metrics.timeseries(window_s)


@get("/workers", sync_to_thread=False, summary="Workers known to this control plane and their load")
def workers(metrics: OpsMetrics) -> dict[str, object]:
    return {"workers": metrics.workers()}


@get("/usage", summary="Usage by tenant and SKU from the usage ledger (token counts)")
async def usage(
    services: Services,
    start: date | None = Parameter(
        query="from", default=None, description="First UTC day (inclusive)"
    ),
    end: date | None = Parameter(query="to", default=None, description="Last UTC day (inclusive)"),
) -> dict[str, object]:
    return {"items": await usage_by_tenant(services.pool, services.view, start, end)}


@get("/usage.csv", media_type="text/csv", summary="Usage by tenant and SKU as CSV")
async def usage_as_csv(
    services: Services,
    start: date | None = Parameter(query="from", default=None),
    end: date | None = Parameter(query="to", default=None),
) -> Response[str]:
    rows = await usage_by_tenant(services.pool, services.view, start, end)
    name = f"tokenmill-usage-{start or 'start'}-{end or 'now'}.csv"
    return Response(
        usage_csv(rows),
        media_type="text/csv",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


@get("/", include_in_schema=False, sync_to_thread=False)
def root() -> Redirect:
    return Redirect("/ui/")


def _page_headers(response: Response) -> Response:
    response.headers.update(PAGE_HEADERS)
    return response


def observability_routes(
    metrics: OpsMetrics, admin_guards: Sequence[Guard] = (), *, with_ledger: bool = True
) -> list[ControllerRouterHandler]:
    """Route handlers to add to the app: `/metrics` (behind the metrics token of
    `metrics.settings`, if any), `/admin/v1/ops/{timeseries,workers}` behind `admin_guards`, the page under `/ui/`, and `/` redirecting to it. `with_ledger`
    adds `/admin/v1/ops/usage[.csv]`, which need the app's `services` dependency."""
    provide = {"metrics": Provide(lambda: metrics, use_cache=True, sync_to_thread=False)}
    handlers: list[ControllerRouterHandler] = [timeseries, workers]
    if with_ledger:
        handlers += [usage, usage_as_csv]
    ops = Router(
        path="/admin/v1/ops",
        route_handlers=handlers,
        guards=list(admin_guards),
        dependencies=provide,
        tags=["operations"],
    )
    token = metrics.settings.metrics_token
    scrape = Router(
        path="/",
        route_handlers=[metrics_endpoint],
        dependencies=provide,
        guards=[scrape_guard(token)] if token else [],
        exception_handlers=PROBLEM_HANDLERS,
    )
    page = create_static_files_router(
        path="/ui",
        directories=[web_dir()],
        html_mode=True,
        name="ops-page",
        cache_control=CacheControlHeader(no_cache=True),
        after_request=_page_headers,
    )
    return [scrape, ops, page, root]
