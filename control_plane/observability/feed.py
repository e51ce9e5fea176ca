"""What feeds OpsMetrics inside a running control plane: worker presence from NATS, request
outcomes from the gateway, event-append timings, and, read at scrape time, the projection lag
(Postgres positions against the stream heads) and the open quota reservations (admission's
in-memory ledger).

SKUs are labelled by name (the OpenAI `model` a client calls; ids are opaque), tenants by id
(names need not be unique)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgspec
from litestar.config.app import AppConfig
from litestar.plugins import InitPluginProtocol
from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from control_plane.observability.metrics import OpsMetrics
from events.nats_cluster import unsubscribe_within
from events.projections import all_projections, committed_positions, dead_letters
from worker import protocol as p

if TYPE_CHECKING:
    from control_plane.services import Services

log = logging.getLogger("tokenmill.observability")


class SkuNames(Protocol):
    def sku(self, sku_id: str) -> Any: ...


class SkuCatalog(SkuNames, Protocol):
    def skus(self) -> Iterable[Any]: ...
    def sku_by_name(self, name: str) -> Any: ...


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
        metrics.unbilled_waste.labels(r.tenant_id, sku_label(view, r.sku_id)).inc(getattr(outcome, "unbilled_waste_tokens", 0))  # fmt: skip

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


class OpenReservations(Protocol):
    def open_reservations(self) -> dict[str, tuple[int, int]]: ...


def reservations_reader(
    metrics: OpsMetrics, admission: OpenReservations, view: SkuCatalog
) -> Callable[[], None]:
    """A scrape-time reader of admission's open quota reservations, per SKU name, with 0 for
    every published SKU that holds none."""

    def read() -> None:
        held = {sku_label(view, sku_id): h for sku_id, h in admission.open_reservations().items()}
        metrics.report_reservations(held, skus=[s.name for s in view.skus() if s.active])

    return read


async def projection_lag(services: Services) -> dict[str, tuple[int, float]]:
    """Per projection: (stream messages not yet projected, age in seconds of the oldest of
    them; 0 when caught up)."""
    positions = await committed_positions(services.pool)
    heads: dict[str, int] = {}
    now = datetime.now(UTC)
    out: dict[str, tuple[int, float]] = {}
    for projection in all_projections():
        stream = projection.stream(services.layout)
        if stream not in heads:
            heads[stream] = await services.store.head(stream)
        done = positions.get(projection.name, 0)
        behind = max(0, heads[stream] - done)
        age = 0.0
        if behind:
            oldest = await services.js.get_msg(stream, seq=done + 1)
            if oldest.time is not None:
                age = max(0.0, (now - oldest.time).total_seconds())
        out[projection.name] = (behind, age)
    return out


def projection_lag_reader(metrics: OpsMetrics, services: Services) -> Callable[[], Awaitable[None]]:
    async def read() -> None:
        for name, (messages, seconds) in (await projection_lag(services)).items():
            metrics.set_projection_lag(name, messages, seconds)
        # read from Postgres, so every replica reports what the projector processes recorded
        unresolved = await dead_letters.unresolved_counts(services.pool)
        for projection in all_projections():
            metrics.dead_letters.labels(projection.name).set(unresolved.get(projection.name, 0))

    return read


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
        metrics.on_scrape_async(projection_lag_reader(metrics, services))
        admission = services.extra.get("admission")
        if admission is not None:
            metrics.on_scrape(reservations_reader(metrics, admission, services.view))
        try:
            yield
        finally:
            await unsubscribe_within(sub)

    return run


class _ErrorCode(msgspec.Struct):
    code: str | None = None
    type: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorCode


class _Requested(msgspec.Struct):
    model: str | None = None


def requested_model(body: bytes) -> str | None:
    """The `model` a /v1 request body names, if it is JSON and names one."""
    try:
        model = msgspec.json.decode(body, type=_Requested).model
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # nested too deep
        return None
    return model


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
    only forwards, so the token stream pays one function call per chunk.

    A refusal is labelled with the SKU the request body's `model` names when `sku_of` knows
    it (the SKU name; "" otherwise: a made-up model name must not become a label value)."""

    def __init__(
        self, metrics: OpsMetrics, sku_of: Callable[[str], str | None] | None = None
    ) -> None:
        self.metrics = metrics
        self.sku_of = sku_of

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        app_config.middleware = [*app_config.middleware, self.middleware]
        return app_config

    def middleware(self, app: ASGIApp) -> ASGIApp:
        metrics, sku_of = self.metrics, self.sku_of

        def sku_label_of(request: list[bytes]) -> str:
            if sku_of is None or not request:
                return ""
            model = requested_model(b"".join(request))
            return (sku_of(model) or "") if model else ""

        async def count_refusals(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
                await app(scope, receive, send)
                return
            status = 0
            body: list[bytes] = []
            request: list[bytes] = []  # references to the chunks the handler reads, no copies

            async def reading() -> ReceiveMessage:
                message = await receive()
                if message["type"] == "http.request" and status == 0:
                    request.append(cast(bytes, message.get("body", b"")))
                return message

            # The data plane looks through it to uvicorn's connection (`uvicorn_cycle`).
            reading.__wrapped__ = receive  # type: ignore[attr-defined]

            async def watching(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                    if not refused(status):
                        request.clear()
                elif refused(status):
                    body.append(cast(bytes, message.get("body", b"")))
                    if not message.get("more_body", False):
                        metrics.refuse_admission(
                            refusal_reason(status, b"".join(body)), sku_label_of(request)
                        )
                await send(message)

            await app(scope, receive if sku_of is None else reading, watching)

        return count_refusals

    # What `fast_path.uvicorn.direct_routes` looks for: a 2xx response passes through unchanged.
    middleware.passes_success_through = True  # type: ignore[attr-defined]
