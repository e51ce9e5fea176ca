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
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgspec
from litestar.config.app import AppConfig
from litestar.plugins import InitPluginProtocol
from litestar.types import ASGIApp, Message, Receive, Scope, Send

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


class _ErrorCode(msgspec.Struct):
    code: str | None = None
    type: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorCode


def refusal_reason(status: int, body: bytes) -> str:
    """The OpenAI error code of a refusal's body (else its type, else `http_<status>`)."""
    try:
        error = msgspec.json.decode(body, type=_ErrorBody).error
    except msgspec.DecodeError:
        return f"http_{status}"
    return error.code or error.type or f"http_{status}"


def refused(status: int) -> bool:
    """A refusal turns a request away before any token: a 4xx, or 503 (no live worker). A
    502 is a failure after dispatch, not a refusal."""
    return 400 <= status < 500 or status == 503


class RefusalCounter(InitPluginProtocol):
    """Counts /v1 requests turned away before any token was generated, by the OpenAI error
    code (invalid_api_key, tenant_suspended, model_not_found, rate_limit_exceeded, ...).

    It reads the responses, not exceptions: the completion routes are ASGI handlers that
    write their own error responses (no exception reaches Litestar), while /v1/models and
    Litestar's own refusals go through exception handlers. Both pass this middleware, so every
    refusal counts once wherever it is decided. Past the response start of a 2xx the wrapper
    only forwards, so the token stream pays one function call per chunk."""

    def __init__(self, metrics: OpsMetrics) -> None:
        self.metrics = metrics

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        app_config.middleware = [*app_config.middleware, self.middleware]
        return app_config

    def middleware(self, app: ASGIApp) -> ASGIApp:
        metrics = self.metrics

        async def count_refusals(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
                await app(scope, receive, send)
                return
            status = 0
            body: list[bytes] = []

            async def watching(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                elif refused(status):
                    body.append(cast(bytes, message.get("body", b"")))
                    if not message.get("more_body", False):
                        metrics.refuse_admission(refusal_reason(status, b"".join(body)))
                await send(message)

            await app(scope, receive, watching)

        return count_refusals

    # What `server.direct_routes` looks for: a 2xx response passes through unchanged.
    middleware.passes_success_through = True  # type: ignore[attr-defined]
