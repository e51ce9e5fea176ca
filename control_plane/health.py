"""/healthz (the process answers) and /readyz (NATS and Postgres reachable, the governance
view replayed, the projections caught up, no unresolved dead letters)."""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, Response, get

from control_plane.problems import PROBLEM_JSON, PROBLEM_TYPE_BASE
from control_plane.services import Services
from events.projections.dead_letters import unresolved_counts

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
            dead = await unresolved_counts(services.pool)
    except Exception as e:  # unreachable backends are the answer here, not an error
        checks["postgres"] = checks.get("postgres", False)
        checks["error"] = type(e).__name__
        lags = {}
        dead = {}
    checks["governance_seq"] = services.view.seq
    checks["projection_lag"] = lags
    checks["dead_letters"] = dead
    ready = bool(
        checks["nats"] and checks["postgres"] and lags and max(lags.values()) <= READY_MAX_LAG
    )
    if ready and not dead:
        return Response({"status": "ready", "checks": checks})
    if ready:
        # Caught up, but past events it could not apply: the read models may be missing them.
        detail = (
            "unresolved dead letters in "
            + ", ".join(f"{name} ({n})" for name, n in sorted(dead.items()))
            + "; see `tokenmill projections dead-letters list`"
        )
        reason = "dead_letters"
    else:
        detail = "a backend is unreachable or a projection is behind"
        reason = "not_ready"
    return Response(
        {
            "type": PROBLEM_TYPE_BASE + reason,
            "title": "Not ready",
            "status": 503,
            "detail": detail,
            "reason": reason,
            "instance": request.url.path,
            "checks": checks,
        },
        status_code=503,
        media_type=PROBLEM_JSON,
    )
