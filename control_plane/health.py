"""/healthz (the process answers) and /readyz (what serving needs).

/readyz is ready when NATS and Postgres are reachable, the governance view is replayed, the
projections are caught up, and the gateway's usage follower (quota settlement, when the
governance extension runs) is live; unresolved dead letters make it not ready with their own
reason. It also lists the published SKUs no live worker serves (`unserved_skus`): those do not
make the replica unready, since it still serves every other SKU and answers those with a 503
`model_unavailable`; taking every gateway out of a load balancer for one idle SKU would stop
all of /v1.

It answers within `READY_WITHIN_S` whatever the backends do: the checks that wait on I/O run as
one task shared by the probes that arrive meanwhile (a slow backend costs one check in flight,
not one per probe), and a probe that cannot wait for it answers not ready. With NATS
disconnected the checks that need it are skipped."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from litestar import Request, Response, get

from control_plane.problems import PROBLEM_JSON, PROBLEM_TYPE_BASE
from control_plane.services import Services
from events.projections.dead_letters import unresolved_counts

# A projection further behind its stream than this many events is "not caught up".
READY_MAX_LAG = 1000
# How long a probe waits for the checks that wait on I/O; the answer comes within 250 ms.
READY_WITHIN_S = 0.2


@get("/healthz", summary="Liveness", tags=["health"])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


class _Checks:
    """The I/O checks of one Services, at most one run in flight."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.running: asyncio.Task[dict[str, Any]] | None = None

    def current(self) -> asyncio.Task[dict[str, Any]]:
        if self.running is None or self.running.done():
            self.running = asyncio.create_task(self._run())
        return self.running

    async def _run(self) -> dict[str, Any]:
        s = self.services
        out: dict[str, Any] = {"postgres": False, "projection_lag": {}, "dead_letters": {}}
        try:
            async with asyncio.timeout(2.0):
                out["postgres"] = bool(await s.pool.fetchval("SELECT true"))
                out["dead_letters"] = await unresolved_counts(s.pool)
                if s.nc.is_connected:  # the stream heads come from JetStream
                    out["projection_lag"] = await s.projection_lags()
        except Exception as e:  # unreachable backends are the answer here, not an error
            out["error"] = type(e).__name__
        return out


def _checks_of(services: Services) -> _Checks:
    checks = services.extra.get("readyz")
    if not isinstance(checks, _Checks):
        checks = services.extra["readyz"] = _Checks(services)
    return checks


def _unserved_skus(services: Services) -> list[str] | None:
    """Published SKUs with no live worker (None: this process runs no data plane)."""
    plane = services.extra.get("dataplane")
    if plane is None:
        return None
    try:
        serves = plane.gateway.serves
    except RuntimeError:  # not started
        return sorted(s.name for s in services.view.skus() if s.status == "published")
    return sorted(
        s.name for s in services.view.skus() if s.status == "published" and not serves(s.sku_id)
    )


@get("/readyz", summary="Readiness", tags=["health"])
async def readyz(request: Request[Any, Any, Any], services: Services) -> Response[dict[str, Any]]:
    checks: dict[str, Any] = {"nats": services.nc.is_connected}
    task = _checks_of(services).current()
    timed_out = False
    try:
        async with asyncio.timeout(READY_WITHIN_S):
            io = await asyncio.shield(task)
    except TimeoutError:
        timed_out = True
        io = {"postgres": False, "projection_lag": {}, "dead_letters": {}, "error": "timeout"}
    checks.update(io)
    lags, dead = checks["projection_lag"], checks["dead_letters"]
    checks["governance_seq"] = services.view.seq
    admission = services.extra.get("admission")
    follower_live = True
    if admission is not None:
        with contextlib.suppress(Exception):
            follower_live = bool(admission.ledger.live)
        checks["usage_follower"] = follower_live
    unserved = _unserved_skus(services)
    if unserved is not None:
        checks["unserved_skus"] = unserved
    ready = bool(
        checks["nats"]
        and checks["postgres"]
        and not timed_out
        and follower_live
        and lags
        and max(lags.values()) <= READY_MAX_LAG
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
        detail = (
            "a backend is unreachable, a projection is behind or the usage follower is not live"
        )
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
