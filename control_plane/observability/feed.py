"""What feeds OpsMetrics inside a running control plane: worker presence from NATS, request
outcomes from the gateway, projection lag from Postgres, and event-append timings.

SKUs are labelled by name (the OpenAI `model` a client calls; ids are opaque), tenants by id
(names need not be unique)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from litestar.config.app import AppConfig
from litestar.exceptions import HTTPException
from litestar.plugins import InitPluginProtocol

from control_plane.observability.metrics import OpsMetrics
from worker import protocol as p

if TYPE_CHECKING:
    from control_plane.services import Services

log = logging.getLogger("tokenmill.observability")

# How often the projection lag is read from Postgres (seconds).
PROJECTION_LAG_EVERY_S = 2.0


class SkuNames(Protocol):
    def sku(self, sku_id: str) -> Any: ...


def sku_label(view: SkuNames, sku_id: str) -> str:
    sku = view.sku(sku_id)
    return sku.name if sku is not None else sku_id


class OutcomeLike(Protocol):
    """The gateway's Outcome (control_plane.dataplane.gateway), as far as metrics need it."""

    request: p.GenerateRequest
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    ttft_s: float | None
    e2e_s: float
    itl_s: list[float]


def outcome_listener(metrics: OpsMetrics, view: SkuNames) -> Callable[[OutcomeLike], None]:
    """A listener for `Gateway.on_outcome`: one observation per finished request."""

    def observe(outcome: OutcomeLike) -> None:
        r = outcome.request
        metrics.observe_request(
            sku=sku_label(view, r.sku_id),
            model=r.model,
            tenant=r.tenant_id,
            ttft_s=outcome.ttft_s,
            itl_s=outcome.itl_s,
            e2e_s=outcome.e2e_s,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            cached_tokens=outcome.cached_tokens,
            finish_reason=outcome.finish_reason,
        )

    return observe


def presence_handler(metrics: OpsMetrics, view: SkuNames) -> Callable[[Any], Awaitable[None]]:
    async def on_presence(msg: Any) -> None:
        try:
            message = p.decode_presence(msg.data)
        except msgspec.DecodeError:
            return  # discover requests and foreign messages share the subject space
        metrics.update_worker(
            msgspec.structs.replace(message, sku_id=sku_label(view, message.sku_id))
        )

    return on_presence


def time_appends(metrics: OpsMetrics, store: Any, stream: str) -> None:
    """Time every control-event append of `store` (an EventStore) until JetStream acks it.
    Wraps the instance's bound method: the store offers no hook of its own."""
    append = store.append

    @functools.wraps(append)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await append(*args, **kwargs)
        finally:
            metrics.observe_event_append(stream, time.perf_counter() - started)

    store.append = timed


async def watch_projection_lag(metrics: OpsMetrics, services: Services) -> None:
    while True:
        try:
            for projection, lag in (await services.projection_lags()).items():
                metrics.set_projection_lag(projection, lag)
        except Exception as exc:  # Postgres away: readiness reports it; keep the last figures
            log.debug("projection lag unavailable: %s", exc)
        await asyncio.sleep(PROJECTION_LAG_EVERY_S)


def feeding(
    metrics: OpsMetrics,
) -> Callable[[Services], contextlib.AbstractAsyncContextManager[None]]:
    """The extension's lifespan hook: subscribes and polls while the app serves."""

    @contextlib.asynccontextmanager
    async def run(services: Services) -> AsyncIterator[None]:
        time_appends(metrics, services.store, "control")
        sub = await services.nc.subscribe(
            p.presence_wildcard(services.layout.prefix), cb=presence_handler(metrics, services.view)
        )
        # Workers announce on request: a control plane that starts late still lists them.
        await services.nc.publish(p.discover_subject(services.layout.prefix), b"")
        lag = asyncio.create_task(
            watch_projection_lag(metrics, services), name="observability:projection-lag"
        )
        try:
            yield
        finally:
            lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lag
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    return run


class RefusalCounter(InitPluginProtocol):
    """Counts /v1 requests turned away before any token was generated, by the OpenAI error
    code (invalid_api_key, tenant_suspended, model_not_found, rate_limit_exceeded, ...). It
    watches the app's exceptions, so every refusal counts wherever it is raised: the key
    lookup, a governance admission check, or no live worker (503). Failures after dispatch
    (a 502 from a worker) are not refusals."""

    def __init__(self, metrics: OpsMetrics) -> None:
        self.metrics = metrics

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        app_config.after_exception = [*app_config.after_exception, self.after_exception]
        return app_config

    async def after_exception(self, exc: Exception, scope: Any) -> None:
        if not str(scope.get("path", "")).startswith("/v1/"):
            return
        from control_plane.dataplane.errors import OpenAIError

        if isinstance(exc, OpenAIError):
            if exc.status >= 500 and exc.status != 503:
                return
            self.metrics.refuse_admission(exc.body.error.code or exc.body.error.type)
        elif isinstance(exc, HTTPException) and 400 <= exc.status_code < 500:
            self.metrics.refuse_admission(f"http_{exc.status_code}")
