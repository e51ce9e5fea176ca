"""/healthz (the process answers) and /readyz (NATS and Postgres reachable, the governance
view replayed, the projections caught up)."""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, Response, get

from control_plane.problems import PROBLEM_JSON
from control_plane.services import Services

# A projection further behind its stream than this many events is "not caught up".
READY_MAX_LAG = 1000


@get("/healthz", summary="Liveness", tags=["health"])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness", tags=["health"])
async def readyz(request: Request[Any, Any, Any], services: Services) -> Response[dict[str, Any]]:
    checks: dict[str, Any] = {"nats": services.nc.is_connected}
    try:
        async with asyncio.timeout(2.0):
            checks["postgres"] = await services.pool.fetchval("SELECT true")
            lags = await services.projection_lags()
    except Exception as e:  # unreachable backends are the answer here, not an error
        checks["postgres"] = checks.get("postgres", False)
        checks["error"] = type(e).__name__
        lags = {}
    checks["governance_seq"] = services.view.seq
    checks["projection_lag"] = lags
    ready = bool(
        checks["nats"] and checks["postgres"] and lags and max(lags.values()) <= READY_MAX_LAG
    )
    if ready:
        return Response({"status": "ready", "checks": checks})
    return Response(
        {
            "type": "https://tokenmill.dev/problems/not_ready",
            "title": "Not ready",
            "status": 503,
            "detail": "a backend is unreachable or a projection is behind",
            "reason": "not_ready",
            "instance": request.url.path,
            "checks": checks,
        },
        status_code=503,
        media_type=PROBLEM_JSON,
    )
